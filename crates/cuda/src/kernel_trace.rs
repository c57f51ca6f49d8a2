//! Kernel timelines from CUPTI's activity API, for the speed probes (`bench
//! --timeline`): the GPU start and end of every kernel that ran while a
//! trace was on, the nodes of CUDA graphs included. The device machine has
//! no Nsight Systems, and Nsight Compute times kernels one at a time, so
//! neither shows how the kernels of a decode step overlap (programmatic
//! dependent launch lets a kernel's blocks start before its predecessor
//! ends) or where the GPU idles between them; this does.
//!
//! CUPTI is loaded when the first trace starts (`libcupti.so`, found through
//! `LD_LIBRARY_PATH`: the toolkit's `targets/x86_64-linux/lib` on the
//! device machine, `extras/CUPTI/lib64` in older layouts); without it
//! `KernelTrace::start` returns an error.

use std::alloc::{alloc, dealloc, Layout};
use std::collections::HashMap;
use std::ffi::CStr;
use std::sync::Mutex;

use cudarc::cupti::result::activity;
use cudarc::cupti::sys;
use cudarc::driver::sys::CUcontext;

use crate::device::Gpu;

/// One kernel as CUPTI recorded it (GPU timestamps, nanoseconds).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelRecord {
    pub name: String,
    pub start_ns: u64,
    pub end_ns: u64,
}

/// Records delivered by CUPTI's buffer callbacks, until `take` takes them.
static RECORDS: Mutex<Vec<KernelRecord>> = Mutex::new(Vec::new());
/// Bytes of one activity buffer (CUPTI asks for as many as it needs).
const BUFFER_BYTES: usize = 8 << 20;
const BUFFER_ALIGN: usize = 8;

fn buffer_layout() -> Layout {
    // Constant, valid size and alignment.
    Layout::from_size_align(BUFFER_BYTES, BUFFER_ALIGN).expect("activity buffer layout")
}

unsafe extern "C" fn buffer_requested(buffer: *mut *mut u8, size: *mut usize, max_records: *mut usize) {
    // SAFETY: CUPTI passes valid out-pointers; the buffer is freed in
    // buffer_completed, which CUPTI calls for every buffer it requested.
    unsafe {
        *buffer = alloc(buffer_layout());
        *size = if (*buffer).is_null() { 0 } else { BUFFER_BYTES };
        *max_records = 0;
    }
}

unsafe extern "C" fn buffer_completed(_ctx: CUcontext, _stream: u32, buffer: *mut u8, _size: usize, valid: usize) {
    if buffer.is_null() {
        return;
    }
    let mut got = Vec::new();
    let mut record: *mut sys::CUpti_Activity = std::ptr::null_mut();
    // SAFETY: `buffer` holds `valid` bytes of records written by CUPTI;
    // every kernel record (CUPTI 13's `CUpti_ActivityKernel10` and the
    // versions after it share the fields read here) names its kernel by a
    // string CUPTI keeps alive while the module is loaded.
    unsafe {
        while activity::get_next_record(buffer, valid, &mut record).is_ok() {
            let kind = (*record).kind;
            if kind == sys::CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || kind == sys::CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_KERNEL {
                let k = &*(record as *const sys::CUpti_ActivityKernel10);
                let name = if k.name.is_null() { String::from("?") } else { CStr::from_ptr(k.name).to_string_lossy().into_owned() };
                got.push(KernelRecord { name, start_ns: k.start, end_ns: k.end });
            }
        }
        dealloc(buffer, buffer_layout());
    }
    if let Ok(mut r) = RECORDS.lock() {
        r.extend(got);
    }
}

/// A running trace of every kernel launched in the process (one at a time);
/// dropping it stops the recording.
pub struct KernelTrace(());

const KIND: sys::CUpti_ActivityKind = sys::CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL;

impl KernelTrace {
    /// Starts recording kernels (loading CUPTI the first time).
    pub fn start() -> Result<Self, String> {
        // cudarc panics when the library cannot be loaded.
        let started = std::panic::catch_unwind(|| -> Result<(), String> {
            activity::register_callbacks(Some(buffer_requested), Some(buffer_completed)).map_err(|e| format!("CUPTI callbacks: {e:?}"))?;
            activity::enable(KIND).map_err(|e| format!("CUPTI kernel activity: {e:?}"))
        });
        match started {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e),
            Err(_) => return Err("CUPTI could not be loaded (libcupti.so: add its folder to LD_LIBRARY_PATH)".into()),
        }
        RECORDS.lock().map_err(|_| "trace records lock poisoned".to_string())?.clear();
        Ok(KernelTrace(()))
    }

    /// Waits for the GPU and returns the kernels recorded since the start
    /// or the last `take`, in start order; recording goes on. (Started
    /// before the work it traces is set up, a trace also sees the kernels of
    /// CUDA graphs instantiated after it, whatever CUPTI's version does with
    /// graphs made before.)
    pub fn take(&self, gpu: &Gpu) -> Result<Vec<KernelRecord>, String> {
        gpu.synchronize().map_err(|e| e.to_string())?;
        activity::flush_all(sys::CUpti_ActivityFlag::CUPTI_ACTIVITY_FLAG_FLUSH_FORCED as u32).map_err(|e| format!("CUPTI flush: {e:?}"))?;
        let mut r = std::mem::take(&mut *RECORDS.lock().map_err(|_| "trace records lock poisoned".to_string())?);
        r.sort_by_key(|k| (k.start_ns, k.end_ns));
        Ok(r)
    }
}

impl Drop for KernelTrace {
    fn drop(&mut self) {
        let _ = activity::disable(KIND);
    }
}

/// The records of a trace of `steps` repeated steps cut into steps: at each
/// occurrence of the kernel that runs once a step and starts first (the
/// earliest name seen exactly `steps` times). None when no name qualifies.
pub fn split_steps(records: &[KernelRecord], steps: usize) -> Option<Vec<&[KernelRecord]>> {
    let mut count: HashMap<&str, usize> = HashMap::new();
    for r in records {
        *count.entry(r.name.as_str()).or_default() += 1;
    }
    let marker = records.iter().find(|r| count[r.name.as_str()] == steps)?.name.as_str();
    let starts: Vec<usize> = records.iter().enumerate().filter(|(_, r)| r.name == marker).map(|(i, _)| i).collect();
    Some(starts.iter().enumerate().map(|(j, &s)| &records[s..starts.get(j + 1).copied().unwrap_or(records.len())]).collect())
}

/// One kernel of a step's chain: when it started after the step's first
/// kernel, how long it ran, its gap after the latest end among the kernels
/// before it (negative: it overlapped them), and how far it moved that
/// latest end (its share of the step's span: a kernel that ends under
/// another's end adds nothing, whatever its length).
#[derive(Clone, Debug, PartialEq)]
pub struct ChainRow {
    pub name: String,
    pub start_us: f64,
    pub dur_us: f64,
    pub gap_us: f64,
    pub extends_us: f64,
}

/// A step's timeline: its span (first start to last end), the time some
/// kernel was running (the union of the intervals) and each kernel.
#[derive(Clone, Debug, PartialEq)]
pub struct StepChain {
    pub span_us: f64,
    pub busy_us: f64,
    pub kernels: Vec<ChainRow>,
}

/// The chain of one step's records (in start order).
pub fn chain(step: &[KernelRecord]) -> StepChain {
    let Some(first) = step.first() else { return StepChain { span_us: 0.0, busy_us: 0.0, kernels: Vec::new() } };
    let t0 = first.start_ns;
    let us = |ns: i128| ns as f64 / 1e3;
    let mut kernels = Vec::with_capacity(step.len());
    let (mut last_end, mut busy) = (t0, 0u64);
    for r in step {
        if r.end_ns > last_end.max(r.start_ns) {
            busy += r.end_ns - last_end.max(r.start_ns);
        }
        kernels.push(ChainRow {
            name: r.name.clone(),
            start_us: us(r.start_ns as i128 - t0 as i128),
            dur_us: us(r.end_ns as i128 - r.start_ns as i128),
            gap_us: us(r.start_ns as i128 - last_end as i128),
            extends_us: us(r.end_ns.saturating_sub(last_end) as i128),
        });
        last_end = last_end.max(r.end_ns);
    }
    StepChain { span_us: us(last_end as i128 - t0 as i128), busy_us: us(busy as i128), kernels }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(name: &str, start_ns: u64, end_ns: u64) -> KernelRecord {
        KernelRecord { name: name.into(), start_ns, end_ns }
    }

    #[test]
    fn steps_are_cut_at_the_first_kernel_that_runs_once_a_step() {
        // A setup kernel, then two steps of embed, xnorm x2, head.
        let r = vec![
            rec("setup", 0, 5),
            rec("embed", 10, 12),
            rec("xnorm", 12, 14),
            rec("xnorm", 15, 17),
            rec("head", 18, 20),
            rec("embed", 30, 32),
            rec("xnorm", 32, 34),
            rec("xnorm", 35, 37),
            rec("head", 38, 40),
        ];
        let steps = split_steps(&r, 2).expect("a marker");
        assert_eq!(steps.len(), 2);
        assert_eq!(steps[0].first().map(|k| k.name.as_str()), Some("embed"));
        assert_eq!(steps[0].len(), 4);
        assert_eq!(steps[1][0].start_ns, 30);
        assert!(split_steps(&r, 3).is_none(), "no kernel runs 3 times");
    }

    #[test]
    fn the_chain_shows_gaps_overlaps_and_busy_time() {
        // b overlaps a by 2 us; c starts 3 us after b ends.
        let step = vec![rec("a", 1_000, 5_000), rec("b", 3_000, 6_000), rec("c", 9_000, 10_000)];
        let c = chain(&step);
        assert_eq!(c.kernels.iter().map(|k| k.gap_us).collect::<Vec<_>>(), vec![0.0, -2.0, 3.0]);
        assert_eq!(c.kernels[1].start_us, 2.0);
        assert_eq!(c.kernels[2].dur_us, 1.0);
        assert_eq!(c.span_us, 9.0);
        assert_eq!(c.busy_us, 6.0);
        // The span is the sum of what each kernel added to it.
        assert_eq!(c.kernels.iter().map(|k| k.extends_us).collect::<Vec<_>>(), vec![4.0, 1.0, 4.0]);
        assert_eq!(c.kernels.iter().map(|k| k.extends_us).sum::<f64>(), c.span_us);
        // A kernel inside another's interval adds nothing.
        let inner = chain(&[rec("a", 0, 10_000), rec("b", 2_000, 3_000)]);
        assert_eq!(inner.kernels[1].extends_us, 0.0);
    }
}
