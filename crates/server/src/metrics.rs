//! `/metrics` in the Prometheus text format (version 0.0.4), written by hand.
//!
//! The server counts what it sees at the HTTP edge (requests by endpoint and
//! status, tokens, time to first token, total latency, disconnects); the
//! engine's own counters (queue, batch sizes, prefix cache) come from its
//! stats snapshot at scrape time. Everything here is lock-free or holds a
//! lock for a few instructions; recording never fails.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use lily_engine::EngineStats;

/// Latency buckets, seconds: from a fast TTFT on the GPU to a long CPU
/// generation.
const LATENCY_BUCKETS: &[f64] = &[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0];
const BATCH_BUCKETS: &[u64] = &[1, 2, 4, 8, 16, 32, 64, 128, 256];

/// A cumulative histogram of durations.
#[derive(Debug)]
pub struct Histogram {
    buckets: &'static [f64],
    counts: Vec<AtomicU64>,
    count: AtomicU64,
    sum_micros: AtomicU64,
}

impl Histogram {
    fn new(buckets: &'static [f64]) -> Self {
        Histogram { buckets, counts: buckets.iter().map(|_| AtomicU64::new(0)).collect(), count: AtomicU64::new(0), sum_micros: AtomicU64::new(0) }
    }

    pub fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        for (b, c) in self.buckets.iter().zip(&self.counts) {
            if secs <= *b {
                c.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_micros.fetch_add(u64::try_from(d.as_micros()).unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (b, c) in self.buckets.iter().zip(&self.counts) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {}", c.load(Ordering::Relaxed));
        }
        let count = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let sum = self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        let _ = writeln!(out, "{name}_sum {sum}\n{name}_count {count}");
    }
}

/// Counters of the HTTP edge.
#[derive(Debug)]
pub struct Metrics {
    requests: Mutex<BTreeMap<(&'static str, u16), u64>>,
    pub prompt_tokens: AtomicU64,
    pub completion_tokens: AtomicU64,
    pub cached_tokens: AtomicU64,
    pub ttft: Histogram,
    pub request_duration: Histogram,
    pub in_flight: AtomicI64,
    pub disconnects: AtomicU64,
    pub engine_failures: AtomicU64,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            requests: Mutex::new(BTreeMap::new()),
            prompt_tokens: AtomicU64::new(0),
            completion_tokens: AtomicU64::new(0),
            cached_tokens: AtomicU64::new(0),
            ttft: Histogram::new(LATENCY_BUCKETS),
            request_duration: Histogram::new(LATENCY_BUCKETS),
            in_flight: AtomicI64::new(0),
            disconnects: AtomicU64::new(0),
            engine_failures: AtomicU64::new(0),
        }
    }
}

impl Metrics {
    pub fn record_request(&self, endpoint: &'static str, status: u16) {
        let mut m = match self.requests.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        *m.entry((endpoint, status)).or_insert(0) += 1;
    }

    /// Requests seen for an endpoint and status (tests, logs).
    pub fn requests(&self, endpoint: &'static str, status: u16) -> u64 {
        let m = match self.requests.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        m.get(&(endpoint, status)).copied().unwrap_or(0)
    }

    pub fn record_usage(&self, prompt: usize, completion: usize, cached: usize) {
        self.prompt_tokens.fetch_add(prompt as u64, Ordering::Relaxed);
        self.completion_tokens.fetch_add(completion as u64, Ordering::Relaxed);
        self.cached_tokens.fetch_add(cached as u64, Ordering::Relaxed);
    }

    /// The whole exposition, edge counters then engine counters.
    pub fn render(&self, stats: &EngineStats) -> String {
        let mut out = String::with_capacity(8192);
        let _ = writeln!(out, "# HELP lily_http_requests_total HTTP requests by endpoint and status code.\n# TYPE lily_http_requests_total counter");
        {
            let m = match self.requests.lock() {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
            for ((endpoint, status), n) in m.iter() {
                let _ = writeln!(out, "lily_http_requests_total{{endpoint=\"{endpoint}\",status=\"{status}\"}} {n}");
            }
        }
        let counter = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
        };
        let gauge = |out: &mut String, name: &str, help: &str, v: i64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        };
        counter(&mut out, "lily_prompt_tokens_total", "Prompt tokens of completed requests.", self.prompt_tokens.load(Ordering::Relaxed));
        counter(&mut out, "lily_completion_tokens_total", "Generated tokens of completed requests.", self.completion_tokens.load(Ordering::Relaxed));
        counter(
            &mut out,
            "lily_cached_prompt_tokens_total",
            "Prompt tokens served from the prefix cache (as reported in usage).",
            self.cached_tokens.load(Ordering::Relaxed),
        );
        gauge(&mut out, "lily_http_requests_in_flight", "Generation requests being served.", self.in_flight.load(Ordering::Relaxed));
        counter(&mut out, "lily_client_disconnects_total", "Requests cancelled because the client went away.", self.disconnects.load(Ordering::Relaxed));
        counter(&mut out, "lily_engine_failures_total", "Accepted requests that failed inside the engine.", self.engine_failures.load(Ordering::Relaxed));
        self.ttft.render(&mut out, "lily_time_to_first_token_seconds", "Time from request arrival to the first generated token.");
        self.request_duration.render(&mut out, "lily_request_duration_seconds", "Time from request arrival to the end of the response.");

        gauge(&mut out, "lily_engine_running", "Requests admitted (prefilling, generating, or paused for KV memory).", stats.running as i64);
        gauge(&mut out, "lily_engine_waiting", "Requests waiting for admission.", stats.waiting as i64);
        counter(&mut out, "lily_engine_requests_submitted_total", "Requests accepted by the engine.", stats.requests_submitted);
        counter(&mut out, "lily_engine_requests_finished_total", "Requests the engine finished.", stats.requests_finished);
        counter(&mut out, "lily_engine_requests_failed_total", "Requests the engine failed.", stats.requests_failed);
        counter(&mut out, "lily_engine_requests_cancelled_total", "Requests cancelled in the engine.", stats.requests_cancelled);
        counter(&mut out, "lily_engine_prompt_tokens_total", "Prompt tokens admitted (cached included).", stats.prompt_tokens);
        counter(&mut out, "lily_engine_prefill_tokens_total", "Prompt tokens run through the model.", stats.prefill_tokens);
        counter(&mut out, "lily_engine_generated_tokens_total", "Tokens generated.", stats.generated_tokens);
        counter(&mut out, "lily_prefix_cache_hits_total", "Requests that reused a cached prefix.", stats.prefix_cache_hits);
        counter(&mut out, "lily_prefix_cache_lookups_total", "Prefix cache lookups.", stats.prefix_cache_lookups);
        counter(&mut out, "lily_prefix_cache_reused_tokens_total", "Prompt tokens restored from the prefix cache.", stats.prefix_cache_tokens);
        counter(&mut out, "lily_prefix_cache_evictions_total", "Prefix cache entries evicted.", stats.prefix_cache_evictions);
        gauge(&mut out, "lily_prefix_cache_entries", "Snapshots held by the prefix cache.", stats.prefix_cache_entries as i64);
        gauge(&mut out, "lily_prefix_cache_held_tokens", "Tokens covered by held snapshots.", stats.prefix_cache_held_tokens as i64);
        counter(&mut out, "lily_decode_steps_total", "Decode steps run.", stats.decode_steps);
        counter(&mut out, "lily_engine_preemptions_total", "Requests paused to give KV memory to older ones (recomputed later).", stats.preemptions);
        counter(&mut out, "lily_engine_arrival_waits_total", "Times an idle engine held its first prefill for requests still arriving.", stats.arrival_waits);
        counter(&mut out, "lily_engine_arrival_gathered_total", "Requests those waits added to the first prefill.", stats.arrival_gathered);
        counter(&mut out, "lily_engine_mixed_steps_total", "Decode steps run inside a prefill pass, beside prompt chunks.", stats.mixed_steps);
        let seconds = |out: &mut String, name: &str, help: &str, v: f64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v:.6}");
        };
        let t = &stats.time;
        seconds(&mut out, "lily_engine_step_seconds_total", "Engine-thread time in steps that had work.", t.step_s);
        seconds(&mut out, "lily_engine_decode_submit_seconds_total", "Of it, staging and launching decode steps.", t.decode_submit_s);
        seconds(&mut out, "lily_engine_decode_wait_seconds_total", "Of it, waiting for the device to finish decode steps.", t.decode_wait_s);
        seconds(&mut out, "lily_engine_prefill_seconds_total", "Of it, in prefill calls.", t.prefill_s);
        seconds(
            &mut out,
            "lily_engine_arrival_wait_seconds_total",
            "Outside the steps: waiting for arriving requests before a first prefill.",
            t.arrival_wait_s,
        );
        if let Some((free, total)) = stats.kv_tokens {
            gauge(&mut out, "lily_kv_cache_free_tokens", "Free tokens in the KV pool.", free as i64);
            gauge(&mut out, "lily_kv_cache_total_tokens", "Tokens the KV pool holds.", total as i64);
        }

        let name = "lily_decode_batch_size";
        let _ = writeln!(out, "# HELP {name} Sequences per decode step.\n# TYPE {name} histogram");
        let (mut count, mut sum) = (0u64, 0u64);
        for (size, n) in stats.decode_batch_sizes.iter().enumerate() {
            count += n;
            sum += size as u64 * n;
        }
        for b in BATCH_BUCKETS {
            let le: u64 = stats.decode_batch_sizes.iter().enumerate().filter(|(size, _)| *size as u64 <= *b).map(|(_, n)| *n).sum();
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {le}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}\n{name}_sum {sum}\n{name}_count {count}");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_is_well_formed() {
        let m = Metrics::default();
        m.record_request("chat", 200);
        m.record_request("chat", 200);
        m.record_request("chat", 400);
        m.record_usage(10, 5, 4);
        m.ttft.observe(Duration::from_millis(30));
        m.request_duration.observe(Duration::from_secs(2));
        let time = lily_engine::EngineTime { step_s: 2.5, decode_submit_s: 0.25, decode_wait_s: 1.5, prefill_s: 0.125, arrival_wait_s: 0.0625 };
        let stats = EngineStats { decode_batch_sizes: vec![0, 3, 2, 0, 1], time, ..EngineStats::default() };
        let text = m.render(&stats);
        assert!(text.contains("lily_http_requests_total{endpoint=\"chat\",status=\"200\"} 2\n"));
        assert!(text.contains("lily_http_requests_total{endpoint=\"chat\",status=\"400\"} 1\n"));
        assert!(text.contains("lily_prompt_tokens_total 10\n"));
        assert!(text.contains("lily_cached_prompt_tokens_total 4\n"));
        assert!(text.contains("lily_time_to_first_token_seconds_bucket{le=\"0.025\"} 0\n"));
        assert!(text.contains("lily_time_to_first_token_seconds_bucket{le=\"0.05\"} 1\n"));
        assert!(text.contains("lily_request_duration_seconds_sum 2\n"));
        assert!(text.contains("lily_decode_batch_size_bucket{le=\"1\"} 3\n"));
        assert!(text.contains("lily_decode_batch_size_bucket{le=\"2\"} 5\n"));
        assert!(text.contains("lily_decode_batch_size_bucket{le=\"4\"} 6\n"));
        assert!(text.contains("lily_decode_batch_size_sum 11\n"));
        assert!(text.contains("lily_engine_step_seconds_total 2.500000\n"));
        assert!(text.contains("lily_engine_decode_submit_seconds_total 0.250000\n"));
        assert!(text.contains("lily_engine_decode_wait_seconds_total 1.500000\n"));
        assert!(text.contains("lily_engine_prefill_seconds_total 0.125000\n"));
        assert!(text.contains("lily_engine_arrival_wait_seconds_total 0.062500\n"));
        // Every sample line is `name{labels} value` with a numeric value, and
        // every metric has HELP and TYPE lines.
        for line in text.lines() {
            if line.starts_with('#') {
                assert!(line.starts_with("# HELP ") || line.starts_with("# TYPE "), "{line}");
                continue;
            }
            let (_, value) = line.rsplit_once(' ').unwrap();
            assert!(value.parse::<f64>().is_ok(), "{line}");
        }
    }
}
