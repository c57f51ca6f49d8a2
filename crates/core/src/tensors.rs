//! Memory-mapped safetensors: one file or a sharded set with
//! `model.safetensors.index.json`.
//!
//! Headers are parsed with the `safetensors` crate, which rejects malformed
//! or truncated files; tensor data is never copied unless it is misaligned
//! for the requested element type. The store records which tensors were taken
//! so the loader can refuse a checkpoint with tensors the model does not use.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use memmap2::Mmap;
use safetensors::SafeTensors;

use crate::error::{Error, Result};

/// Element types Lily reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    BF16,
    F16,
    F32,
    U32,
    U8,
    I64,
    Other,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::BF16 | DType::F16 => 2,
            DType::F32 | DType::U32 => 4,
            DType::U8 => 1,
            DType::I64 => 8,
            DType::Other => 0,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::BF16 => "BF16",
            DType::F16 => "F16",
            DType::F32 => "F32",
            DType::U32 => "U32",
            DType::U8 => "U8",
            DType::I64 => "I64",
            DType::Other => "unsupported",
        }
    }
    fn from_st(d: safetensors::Dtype) -> Self {
        use safetensors::Dtype as D;
        match d {
            D::BF16 => DType::BF16,
            D::F16 => DType::F16,
            D::F32 => DType::F32,
            D::U32 => DType::U32,
            D::U8 => DType::U8,
            D::I64 => DType::I64,
            _ => DType::Other,
        }
    }
    pub fn to_st(self) -> safetensors::Dtype {
        use safetensors::Dtype as D;
        match self {
            DType::BF16 => D::BF16,
            DType::F16 => D::F16,
            DType::F32 => D::F32,
            DType::U32 => D::U32,
            DType::U8 => D::U8,
            DType::I64 => D::I64,
            DType::Other => D::U8,
        }
    }
}

struct Shard {
    path: PathBuf,
    map: Arc<Mmap>,
}

#[derive(Clone, Debug)]
struct Entry {
    shard: usize,
    dtype: DType,
    shape: Vec<usize>,
    /// Byte range inside the mapped file (header included in the offset).
    start: usize,
    end: usize,
}

/// A borrowed view of one tensor's bytes in a mapped file.
#[derive(Clone)]
pub struct TensorRef {
    pub name: String,
    pub file: PathBuf,
    pub dtype: DType,
    pub shape: Vec<usize>,
    map: Arc<Mmap>,
    start: usize,
    end: usize,
}

impl std::fmt::Debug for TensorRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {:?} {} in {}", self.name, self.shape, self.dtype.name(), self.file.display())
    }
}

impl TensorRef {
    pub fn bytes(&self) -> &[u8] {
        &self.map[self.start..self.end]
    }
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The data as u32 words (packed quantised codes), borrowed when aligned.
    pub fn as_u32(&self) -> Cow<'_, [u32]> {
        cast_or_copy(self.bytes(), u32::from_le_bytes)
    }

    /// The data as raw 16-bit words (bf16 / f16 bit patterns).
    pub fn as_u16(&self) -> Cow<'_, [u16]> {
        cast_or_copy(self.bytes(), u16::from_le_bytes)
    }

    /// Converts any float tensor to f32 (copies).
    pub fn to_f32(&self) -> Vec<f32> {
        let b = self.bytes();
        match self.dtype {
            DType::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            DType::BF16 => b.chunks_exact(2).map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()).collect(),
            DType::F16 => b.chunks_exact(2).map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()).collect(),
            _ => Vec::new(),
        }
    }

    fn error(&self, message: impl Into<String>) -> Error {
        Error::Tensor { tensor: self.name.clone(), file: self.file.clone(), message: message.into() }
    }

    /// Checks shape and dtype, with a message naming tensor and file.
    pub fn expect(&self, dtypes: &[DType], shape: &[usize]) -> Result<()> {
        if !dtypes.contains(&self.dtype) {
            let want: Vec<_> = dtypes.iter().map(|d| d.name()).collect();
            return Err(self.error(format!("dtype is {}, expected {}", self.dtype.name(), want.join(" or "))));
        }
        if self.shape != shape {
            return Err(self.error(format!("shape is {:?}, expected {:?}", self.shape, shape)));
        }
        Ok(())
    }
}

fn cast_or_copy<T: bytemuck::Pod, const N: usize>(bytes: &[u8], from_le: fn([u8; N]) -> T) -> Cow<'_, [T]> {
    match bytemuck::try_cast_slice::<u8, T>(bytes) {
        Ok(words) if cfg!(target_endian = "little") => Cow::Borrowed(words),
        _ => Cow::Owned(
            bytes
                .chunks_exact(N)
                .map(|c| {
                    let mut a = [0u8; N];
                    a.copy_from_slice(c);
                    from_le(a)
                })
                .collect(),
        ),
    }
}

/// All tensors of a checkpoint directory, mapped.
pub struct TensorStore {
    shards: Vec<Shard>,
    entries: BTreeMap<String, Entry>,
    taken: Mutex<HashSet<String>>,
}

impl TensorStore {
    /// Opens `model.safetensors.index.json` if present, else every
    /// `*.safetensors` file in `dir`.
    pub fn open_dir(dir: &Path) -> Result<Self> {
        let index_path = dir.join("model.safetensors.index.json");
        let mut files: Vec<PathBuf> = Vec::new();
        let mut index: Option<HashMap<String, String>> = None;
        if index_path.exists() {
            let text = std::fs::read_to_string(&index_path).map_err(|e| Error::io(&index_path, e))?;
            let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Json { path: index_path.clone(), message: e.to_string() })?;
            let map = value
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| Error::Json { path: index_path.clone(), message: "no `weight_map` object".into() })?;
            let mut names = HashMap::new();
            for (tensor, file) in map {
                let file =
                    file.as_str().ok_or_else(|| Error::Json { path: index_path.clone(), message: format!("weight_map[{tensor:?}] is not a file name") })?;
                if file.contains('/') || file.contains("..") {
                    return Err(Error::Json {
                        path: index_path.clone(),
                        message: format!("weight_map[{tensor:?}] = {file:?} leaves the checkpoint directory"),
                    });
                }
                names.insert(tensor.clone(), file.to_string());
            }
            let mut unique: Vec<String> = names.values().cloned().collect();
            unique.sort();
            unique.dedup();
            files = unique.into_iter().map(|f| dir.join(f)).collect();
            index = Some(names);
        } else {
            let rd = std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
            for entry in rd {
                let entry = entry.map_err(|e| Error::io(dir, e))?;
                let p = entry.path();
                if p.extension().and_then(|e| e.to_str()) == Some("safetensors") {
                    files.push(p);
                }
            }
            files.sort();
            if files.is_empty() {
                return Err(Error::Other(format!("{}: no model.safetensors.index.json and no *.safetensors files", dir.display())));
            }
        }
        let store = Self::open_files(&files)?;
        if let Some(index) = index {
            // The index must agree with the files: every listed tensor is in
            // the file it names, and no file holds a tensor the index omits.
            for (tensor, file) in &index {
                let entry = store
                    .entries
                    .get(tensor)
                    .ok_or_else(|| Error::Safetensors { file: dir.join(file), message: format!("index lists `{tensor}` but the file does not contain it") })?;
                let actual = &store.shards[entry.shard].path;
                if actual.file_name().and_then(|f| f.to_str()) != Some(file.as_str()) {
                    return Err(Error::Safetensors { file: actual.clone(), message: format!("`{tensor}` is here but the index says {file}") });
                }
            }
            if let Some((name, entry)) = store.entries.iter().find(|(n, _)| !index.contains_key(*n)) {
                return Err(Error::Safetensors {
                    file: store.shards[entry.shard].path.clone(),
                    message: format!("`{name}` is not listed in model.safetensors.index.json"),
                });
            }
        }
        Ok(store)
    }

    /// Maps and parses the given files.
    pub fn open_files(files: &[PathBuf]) -> Result<Self> {
        let mut shards = Vec::new();
        let mut entries = BTreeMap::new();
        for (i, path) in files.iter().enumerate() {
            let file = File::open(path).map_err(|e| Error::io(path, e))?;
            // SAFETY: the checkpoint is opened read-only; Lily never writes to
            // it while mapped. A file truncated by another process after this
            // point would fault, which is the documented mmap contract.
            let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
            let parsed =
                SafeTensors::deserialize(&map).map_err(|e| Error::Safetensors { file: path.clone(), message: format!("not a valid safetensors file: {e}") })?;
            let (header_len, _) = SafeTensors::read_metadata(&map)
                .map_err(|e| Error::Safetensors { file: path.clone(), message: format!("not a valid safetensors file: {e}") })?;
            let base = 8 + header_len;
            for (name, view) in parsed.tensors() {
                let data = view.data();
                // The view borrows from `map`; turn it back into offsets.
                let start = data.as_ptr() as usize - map.as_ptr() as usize;
                debug_assert!(start >= base);
                let entry = Entry { shard: i, dtype: DType::from_st(view.dtype()), shape: view.shape().to_vec(), start, end: start + data.len() };
                if entries.insert(name.clone(), entry).is_some() {
                    return Err(Error::Safetensors { file: path.clone(), message: format!("tensor `{name}` appears in more than one file") });
                }
            }
            shards.push(Shard { path: path.clone(), map: Arc::new(map) });
        }
        Ok(Self { shards, entries, taken: Mutex::new(HashSet::new()) })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    pub fn files(&self) -> Vec<PathBuf> {
        self.shards.iter().map(|s| s.path.clone()).collect()
    }

    /// Total bytes of tensor data.
    pub fn data_bytes(&self) -> usize {
        self.entries.values().map(|e| e.end - e.start).sum()
    }

    /// Looks a tensor up without marking it used.
    pub fn peek(&self, name: &str) -> Option<TensorRef> {
        let e = self.entries.get(name)?;
        let shard = &self.shards[e.shard];
        Some(TensorRef {
            name: name.to_string(),
            file: shard.path.clone(),
            dtype: e.dtype,
            shape: e.shape.clone(),
            map: shard.map.clone(),
            start: e.start,
            end: e.end,
        })
    }

    /// Takes a tensor, checking dtype and shape, and marks it used.
    pub fn take(&self, name: &str, dtypes: &[DType], shape: &[usize]) -> Result<TensorRef> {
        let t = self.peek(name).ok_or_else(|| Error::MissingTensor { tensor: name.to_string(), searched: self.describe_files() })?;
        t.expect(dtypes, shape)?;
        self.taken.lock().map_err(|_| Error::Other("tensor store lock poisoned".into()))?.insert(name.to_string());
        Ok(t)
    }

    /// Fails if a tensor was never taken, unless `ignored` says to skip it.
    pub fn check_all_used(&self, ignored: impl Fn(&str) -> bool) -> Result<()> {
        let taken = self.taken.lock().map_err(|_| Error::Other("tensor store lock poisoned".into()))?;
        let unused: Vec<(&String, &Entry)> = self.entries.iter().filter(|(n, _)| !taken.contains(*n) && !ignored(n)).collect();
        match unused.first() {
            None => Ok(()),
            Some((name, entry)) => Err(Error::UnusedTensors { count: unused.len(), example: (*name).clone(), file: self.shards[entry.shard].path.clone() }),
        }
    }

    fn describe_files(&self) -> String {
        let names: Vec<String> = self.shards.iter().map(|s| s.path.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default()).collect();
        if names.len() <= 3 {
            names.join(", ")
        } else {
            format!("{} files: {} ... {}", names.len(), names[0], names[names.len() - 1])
        }
    }
}
