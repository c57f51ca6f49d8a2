//! The engine thread: starting it, feeding it, stopping it.
//!
//! `Engine::start` moves the backend and tokenizer onto one dedicated OS
//! thread (a backend is `Send` but not shared: one owner drives the device)
//! and returns the cloneable `EngineHandle`. The thread sleeps on its command
//! queue while idle and otherwise runs `Scheduler::step` back to back,
//! draining the queue between steps so new requests join the batch at once.
//! A panic inside a step fails the requests in flight and the engine keeps
//! serving. It exits after `shutdown` (or when every handle is dropped) once
//! every accepted request has finished. Each time it goes idle after work it
//! hands the freed heap back to the OS (`release_freed_heap`). Before the
//! first step after nothing ran, it waits briefly for requests the front end
//! is still preparing, and for the follow-ups of requests that ended
//! together (`gather_arrivals`, `Burst`), so a burst starts in one prefill.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lily_core::tokenizer::Tokenizer;
use lily_model::Backend;

use crate::api::{Command, EngineHandle, EngineOptions, ModelInfo, Shared};
use crate::scheduler::Scheduler;

/// Entry point: `Engine::start(backend, tokenizer, options)`.
pub struct Engine;

impl Engine {
    /// Spawns the engine thread that owns `backend`. `tokenizer` is a
    /// `Tokenizer` or an `Arc<Tokenizer>` (the server shares one with its
    /// chat templating). The only failure is the OS refusing to create the
    /// thread.
    pub fn start(backend: Box<dyn Backend>, tokenizer: impl Into<Arc<Tokenizer>>, opts: EngineOptions) -> std::io::Result<EngineHandle> {
        let tokenizer = tokenizer.into();
        let backend_max = backend.max_seq_len();
        let context_length = opts.max_seq_len.map_or(backend_max, |m| m.min(backend_max));
        let info = ModelInfo {
            name: opts.model_name.clone(),
            backend: backend.name(),
            context_length,
            vocab_size: backend.config().vocab_size,
            eos_token_ids: backend.config().eos_token_ids.clone(),
            synthetic: opts.synthetic,
        };
        let (tx, rx) = std::sync::mpsc::channel();
        let shared = Arc::new(Shared::new(info, opts.max_queue));
        let sched = Scheduler::new(backend, tokenizer, &opts, shared.clone());
        let thread_shared = shared.clone();
        let arrival_wait = opts.arrival_wait;
        std::thread::Builder::new().name("lily-engine".into()).spawn(move || run(sched, rx, thread_shared, arrival_wait))?;
        Ok(EngineHandle { shared, commands: tx })
    }
}

/// Marks the engine stopped however the thread ends.
struct StoppedGuard(Arc<Shared>);

impl Drop for StoppedGuard {
    fn drop(&mut self) {
        self.0.mark_stopped();
    }
}

/// How long the engine stays idle before it returns freed heap pages to
/// the OS (`release_freed_heap`, a few milliseconds of work).
const TRIM_AFTER_IDLE: Duration = Duration::from_millis(250);

fn run(mut sched: Scheduler, rx: Receiver<Command>, shared: Arc<Shared>, arrival_wait: Duration) {
    let _guard = StoppedGuard(shared.clone());
    let mut draining = false;
    // Whether a step ran since the engine last went idle.
    let mut worked = false;
    let mut burst = Burst::default();
    let intake = |sched: &mut Scheduler, cmd: Command, draining: &mut bool| match cmd {
        Command::Submit(mut sub) => {
            // Queued first, then the announcement ends (`Arrival`).
            let arrival = sub.arrival.take();
            sched.enqueue(sub);
            drop(arrival);
        }
        Command::Shutdown => *draining = true,
    };
    loop {
        if sched.is_idle() {
            if draining {
                break;
            }
            // Once per transition to idle, never while requests run, and
            // only after `TRIM_AFTER_IDLE` without a new request: a client
            // that sends its next request as soon as the last one ends
            // (one chat user, a benchmark) must not wait for the trim.
            let cmd = if worked {
                match rx.recv_timeout(TRIM_AFTER_IDLE) {
                    Ok(cmd) => Ok(cmd),
                    Err(RecvTimeoutError::Timeout) => {
                        release_freed_heap();
                        worked = false;
                        rx.recv()
                    }
                    Err(RecvTimeoutError::Disconnected) => break,
                }
            } else {
                rx.recv()
            };
            match cmd {
                Ok(cmd) => intake(&mut sched, cmd, &mut draining),
                // Every handle is gone: nobody can submit or listen.
                Err(_) => break,
            }
        }
        loop {
            match rx.try_recv() {
                Ok(cmd) => intake(&mut sched, cmd, &mut draining),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    draining = true;
                    break;
                }
            }
        }
        if sched.is_idle() {
            continue;
        }
        if !draining && sched.only_waiting() {
            let expected = burst.take_expected(EXPECT_WITHIN.max(arrival_wait));
            let newcomer = sched.newcomer_waits();
            gather_arrivals(&mut sched, &rx, &shared, arrival_wait, Expect { expected, newcomer }, &mut draining, intake);
        }
        worked = true;
        let ended_before = sched.ended();
        let stepped = catch_unwind(AssertUnwindSafe(|| sched.step()));
        burst.count(sched.ended() - ended_before);
        if let Err(panic) = stepped {
            let why = panic_message(&panic);
            tracing::error!("engine step panicked: {why}; failing the requests in flight");
            if catch_unwind(AssertUnwindSafe(|| sched.fail_all(&format!("engine step panicked: {why}")))).is_err() {
                tracing::error!("engine could not recover from a panic; stopping");
                return;
            }
        }
    }
    if catch_unwind(AssertUnwindSafe(|| sched.clear_cache())).is_err() {
        tracing::error!("freeing the prefix cache panicked at shutdown");
    }
}

/// Requests that end within this of each other count as ending together
/// (`Burst`): a few decode steps.
const ENDED_TOGETHER: Duration = Duration::from_millis(10);
/// How soon after requests ended together the next one must reach an idle
/// engine for the others to be expected too: a client sends its next
/// request within a few milliseconds of the last one's end. (An arrival
/// wait longer than this keeps the expectation as long.)
const EXPECT_WITHIN: Duration = Duration::from_millis(50);

/// Requests that ended together, so that when the next one reaches an idle
/// engine it waits for the others' clients too (each a request that ended
/// and will likely send another: benchmark rounds, agents working in
/// step). A request's announcement (`Arrival`) covers only its own
/// preparation, which with the tokenizer's hand split and inline
/// preparation (~0.3 ms) ends before the next client's request comes
/// (~0.4-0.6 ms apart from a Python client's threads): without this a
/// lockstep burst started as one pass of 1 prompt and one of 7.
#[derive(Default)]
struct Burst {
    ended: usize,
    last_end: Option<Instant>,
}

impl Burst {
    /// Counts requests that ended in a step.
    fn count(&mut self, ended: usize) {
        if ended == 0 {
            return;
        }
        let now = Instant::now();
        if self.last_end.is_none_or(|t| now - t > ENDED_TOGETHER) {
            self.ended = 0;
        }
        self.ended += ended;
        self.last_end = Some(now);
    }

    /// How many more requests to expect besides the one that came: the
    /// others that ended with its predecessor, if that was within `window`.
    /// Taken once.
    fn take_expected(&mut self, window: Duration) -> usize {
        let recent = self.last_end.is_some_and(|t| t.elapsed() <= window);
        let expected = if recent { self.ended.saturating_sub(1) } else { 0 };
        *self = Burst::default();
        expected
    }
}

/// While gathering, how long the queue may stay quiet, with no request
/// being prepared, before the pass starts anyway: requests of one burst
/// reach the server a fraction of a millisecond apart, so the next one may
/// be announced just after the one before it was queued.
const GATHER_QUIET: Duration = Duration::from_micros(500);
/// How often a gathering engine looks at the arrival count while requests
/// are being prepared (one that is refused never reaches the queue).
const GATHER_POLL: Duration = Duration::from_micros(100);
/// The quiet gap for a newcomer (`Expect::newcomer`) is the limit over
/// this: 0.5 ms of the default 6 ms, about the spread of a burst of
/// clients that start together (~0.4-0.6 ms between a Python benchmark's
/// threads). Measured on the H100 host (session 48): with preparation at
/// ~0.3 ms, each request was queued before the next client's came, so
/// every 8-client phase began with one prompt alone (18.6 ms) before the
/// other seven (50.6 ms); on the H200 host of session 44, whose
/// preparation took 0.8-1.3 ms, the announcements had overlapped.
const NEWCOMER_GAP_DIV: u32 = 12;

/// What an idle engine's first prefill may wait for besides the requests
/// being prepared (`gather_arrivals`).
struct Expect {
    /// More requests expected: the follow-ups of requests that ended
    /// together with the last one (`Burst`).
    expected: usize,
    /// The oldest waiting request comes from another client than the
    /// request that ended last (`Scheduler::newcomer_waits`): others may be
    /// right behind it.
    newcomer: bool,
}

/// Holds the first prefill of an engine with nothing running while a front
/// end is preparing more requests (`Arrival`s held) or while fewer than
/// `expected` more have come (`Burst`), taking each as it is submitted,
/// until for the quiet gap none has been prepared and none queued, or
/// `limit` has passed since the wait began. The gap is `GATHER_QUIET`, or
/// while expected requests are missing, `limit` until the first of them
/// has come and a quarter of it after; once they are
/// all here and none is being prepared, or the waiting prompts fill a
/// prefill pass (64 clients' follow-ups fill several), the wait ends at
/// once. A newcomer (`Expect::newcomer`) with nothing else expected waits
/// for a quiet gap of `limit / NEWCOMER_GAP_DIV`. Returns at once when
/// nothing is arriving or expected and the request is its client's next,
/// so one client's requests never wait. Measured without it: a burst of 8
/// started as one pass of 1 prompt and one of 7 (`DEFAULT_ARRIVAL_WAIT`).
fn gather_arrivals(
    sched: &mut Scheduler,
    rx: &Receiver<Command>,
    shared: &Shared,
    limit: Duration,
    expect: Expect,
    draining: &mut bool,
    intake: impl Fn(&mut Scheduler, Command, &mut bool),
) {
    let Expect { expected, newcomer } = expect;
    if limit.is_zero() || (shared.arriving.load(Ordering::SeqCst) == 0 && expected == 0 && !newcomer) {
        return;
    }
    // The quiet gap once nothing is missing: a newcomer's burst spreads
    // wider than one front end's back-to-back preparations.
    let quiet = if newcomer && expected == 0 { limit / NEWCOMER_GAP_DIV } else { GATHER_QUIET };
    let start = Instant::now();
    let before = sched.waiting_len();
    let mut last = start;
    loop {
        let now = Instant::now();
        let Some(left) = limit.checked_sub(now - start).filter(|l| !l.is_zero()) else { break };
        if sched.pass_is_full() {
            break;
        }
        let came = sched.waiting_len().saturating_sub(before);
        let missing = came < expected;
        let wait = if shared.arriving.load(Ordering::SeqCst) > 0 {
            // The quiet gap counts from the last request being prepared.
            last = now;
            GATHER_POLL
        } else if expected > 0 && !missing {
            break;
        } else {
            // The first expected follow-up comes a client's whole
            // turnaround after the engine emitted its predecessor's last
            // token: on the H100 host more than a quarter of the 6 ms
            // limit after this wait began, when the request that came
            // first was a step ahead of the others (it had started in a
            // lone pass). Until one has come, only the limit bounds the
            // wait; then the followers' spread, a quarter of it.
            let gap = match (missing, came > 0) {
                (true, false) => limit,
                (true, true) => limit / 4,
                (false, _) => quiet,
            };
            match gap.checked_sub(now - last).filter(|q| !q.is_zero()) {
                Some(q) => q,
                None => break,
            }
        };
        match rx.recv_timeout(wait.min(left)) {
            Ok(cmd) => {
                intake(sched, cmd, draining);
                last = Instant::now();
                if *draining {
                    break;
                }
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => {
                *draining = true;
                break;
            }
        }
    }
    let waited = start.elapsed();
    let gathered = sched.waiting_len().saturating_sub(before);
    tracing::debug!(gathered, expected, newcomer, waited_us = waited.as_micros() as u64, "held the first prefill for arriving requests");
    shared.with_stats(|s| {
        s.arrival_waits += 1;
        s.arrival_gathered += gathered as u64;
        s.time.arrival_wait_s += waited.as_secs_f64();
    });
}

/// Returns the heap pages freed since the last load peak to the OS. glibc
/// keeps freed memory resident in its arenas for reuse, so after a peak
/// (a 64-way decode batch copies 64 logits rows of about 1 MB each per
/// step, and the HTTP workers hold many buffers) the process RSS stays at
/// the peak although nothing leaks; trimming when the engine goes idle lets
/// it fall back to its baseline. It costs a few milliseconds, off the hot
/// path.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn release_freed_heap() {
    // SAFETY: malloc_trim takes no pointers; it only walks glibc's own
    // arenas, under their locks, and returns unused pages to the OS, so it
    // is sound from any thread at any time, concurrently with allocation.
    let released = unsafe { libc::malloc_trim(0) };
    tracing::trace!(released = released != 0, "idle: trimmed the heap");
}

/// Other allocators return memory on their own terms; nothing to do.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn release_freed_heap() {}

/// The message a caught panic carries (its `&str` or `String` payload):
/// the engine reports a step's panic with it, the server a prompt
/// preparation's.
pub fn panic_message(p: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".to_string()
    }
}
