#!/usr/bin/env python3
"""Bounded load test of `lily serve` (issue 6, item 6).

N client threads (default 64) send streaming chat requests back to back for
a fixed time. Every response must be complete: HTTP 200, JSON events without
an error, one finish_reason chunk, the usage chunk, then `[DONE]` (the checks
are serve_bench.stream_chat's). Each request gets a random max_tokens up to
--max-tokens and a unique prompt; with --disconnect-fraction some clients
hang up mid-stream on purpose, to exercise cancellation (those are counted
apart, never as failures).

With --server-pid the server's resident memory (VmRSS from
/proc/PID/status) is sampled: before anything (cold), after a warm-up of
the same load for --warmup-s (the baseline), during the load, and after it,
once the server reports no running or waiting requests. It passes when the
final value is within the tolerance of the baseline (max of
--rss-tolerance-mb and --rss-tolerance-pct). Why a warm baseline: glibc's
malloc raises its mmap threshold as large buffers are freed, so after the
first burst of concurrent sequences it keeps their freed buffers in the
heap for reuse. Measured on the CPU demo model, 64 clients: +170 MiB over
the cold value after the first burst, flat (+1 MiB) over further rounds;
with MALLOC_MMAP_THRESHOLD_=65536 the server returns to within 28 MiB of
the cold value. Growth past the warm baseline is what a leak looks like.
The prefix cache keeps entries up to its budget between requests, so its
held tokens are reported from /metrics next to the memory figures.

Exit status: 0 when no request failed and memory came back; 1 otherwise;
2 for bad arguments or an unreachable server. Standard library only;
loopback addresses only.

    python3 scripts/load_test.py --base-url http://127.0.0.1:8000 \
        --clients 64 --duration-s 120 --server-pid $(pgrep -n lily) --json load.json
"""

import argparse
import http.client
import json
import os
import random
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_bench as sb  # noqa: E402  (the shared client and SSE checks)


def rss_kib(pid):
    """VmRSS of `pid` in KiB, or None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def metrics(target):
    """Unlabelled numeric series of /metrics (empty if it is unreachable)."""
    try:
        status, text = target.get_text("/metrics")
    except (OSError, http.client.HTTPException):
        return {}
    if status != 200:
        return {}
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#") or "{" in line:
            continue
        parts = line.split()
        if len(parts) == 2:
            try:
                out[parts[0]] = float(parts[1])
            except ValueError:
                pass
    return out


def health(target):
    try:
        return target.get_json("/health")
    except (OSError, RuntimeError, http.client.HTTPException, ValueError):
        return None


class Sampler(threading.Thread):
    """Samples the server's RSS every `period` seconds."""

    def __init__(self, pid, period):
        super().__init__(daemon=True)
        self.pid = pid
        self.period = period
        self.samples = []
        self.stop_event = threading.Event()

    def run(self):
        t0 = time.perf_counter()
        while not self.stop_event.is_set():
            v = rss_kib(self.pid)
            if v is not None:
                self.samples.append((time.perf_counter() - t0, v))
            self.stop_event.wait(self.period)


def wait_idle(target, timeout):
    """Waits until /health says nothing runs or waits; returns whether it did."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        h = health(target)
        if h is not None and h.get("running", 0) == 0 and h.get("waiting", 0) == 0:
            return True
        time.sleep(0.2)
    return False


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--duration-s", type=float, default=120.0)
    ap.add_argument("--max-tokens", type=int, default=64, help="each request draws max_tokens in 1..this")
    ap.add_argument("--prompt-words", type=int, default=48, help="each prompt has 1..this random words")
    ap.add_argument("--disconnect-fraction", type=float, default=0.0,
                    help="share of requests whose client hangs up after a few tokens on purpose")
    ap.add_argument("--api-key", default=os.environ.get("LILY_API_KEY"))
    ap.add_argument("--model", help="model id (default: the first of /v1/models)")
    ap.add_argument("--server-pid", type=int, help="sample this process's RSS")
    ap.add_argument("--rss-tolerance-mb", type=float, default=64.0)
    ap.add_argument("--rss-tolerance-pct", type=float, default=10.0)
    ap.add_argument("--settle-s", type=float, default=30.0,
                    help="after the load, how long memory may take to come back")
    ap.add_argument("--warmup-s", type=float, default=10.0,
                    help="the same load for this long before the memory baseline (0: none)")
    ap.add_argument("--sample-period-s", type=float, default=0.5)
    ap.add_argument("--timeout-s", type=float, default=300.0, help="socket timeout per request")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", dest="json_out", help="write the report here")
    args = ap.parse_args(argv)
    if args.clients < 1 or args.duration_s <= 0 or args.max_tokens < 1 or args.prompt_words < 1:
        ap.error("--clients, --duration-s, --max-tokens and --prompt-words must be positive")
    if not 0.0 <= args.disconnect_fraction <= 1.0:
        ap.error("--disconnect-fraction must be between 0 and 1")
    try:
        target = sb.Target(args.base_url, args.api_key, args.timeout_s)
    except sb.LoopbackError as e:
        print(f"load_test: {e}", file=sys.stderr)
        return 2
    if args.server_pid is not None and rss_kib(args.server_pid) is None:
        print(f"load_test: cannot read /proc/{args.server_pid}/status", file=sys.stderr)
        return 2
    try:
        model, _ = sb.model_id(target, args.model)
    except (OSError, RuntimeError, http.client.HTTPException, ValueError) as e:
        print(f"load_test: cannot reach a working server at {args.base_url}: {e}", file=sys.stderr)
        return 2

    lock = threading.Lock()
    # Every response is checked, warm-up included; tokens count the load only.
    counts = {"ok": 0, "failed": 0, "disconnected": 0, "load_ok": 0, "completion_tokens": 0}
    # Latencies of the load's complete requests: time to the first token,
    # and every gap between two token chunks.
    ttfts, gaps = [], []
    failures = []
    finish = {}

    def client(i, phase, stop_at, tally):
        crng = random.Random((args.seed * 1_000_003 + i) * 7 + phase)
        conn = target.connect()
        k = 0
        while time.perf_counter() < stop_at:
            max_tokens = crng.randint(1, args.max_tokens)
            words = crng.randint(1, args.prompt_words)
            prompt = sb.make_prompt(crng, words, f"load-{phase}-{i}-{k}-{crng.getrandbits(32):08x}")
            thinking = crng.random() < 0.5
            body = sb.chat_body(model, prompt, max_tokens, thinking=thinking)
            cut = crng.randint(1, 4) if crng.random() < args.disconnect_fraction else None
            r, reusable = sb.stream_chat(target, conn, body, disconnect_after=cut)
            k += 1
            with lock:
                if r.disconnected:
                    counts["disconnected"] += 1
                elif r.ok:
                    counts["ok"] += 1
                    if tally:
                        counts["load_ok"] += 1
                        counts["completion_tokens"] += r.completion_tokens or 0
                        if r.ttft is not None:
                            ttfts.append(r.ttft)
                        gaps.extend(r.gaps)
                    finish[r.finish_reason] = finish.get(r.finish_reason, 0) + 1
                else:
                    counts["failed"] += 1
                    if len(failures) < 20:
                        failures.append(f"{'warm-up' if phase == 0 else 'load'} client {i} request {k}: {r.error}")
            if not reusable:
                conn = target.connect()
        conn.close()

    def run(phase, seconds, tally):
        stop_at = time.perf_counter() + seconds
        threads = [threading.Thread(target=client, args=(i, phase, stop_at, tally), daemon=True)
                   for i in range(args.clients)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - t0

    cold = rss_kib(args.server_pid) if args.server_pid else None
    # Warm-up: the same load, so buffers sized by concurrency (and the
    # allocator's reuse pool, see above) are in place before the baseline.
    if args.warmup_s > 0:
        run(0, args.warmup_s, tally=False)
        wait_idle(target, 30)
    m_before = metrics(target)
    baseline = rss_kib(args.server_pid) if args.server_pid else None

    sampler = None
    if args.server_pid:
        sampler = Sampler(args.server_pid, args.sample_period_s)
        sampler.start()
    wall = run(1, args.duration_s, tally=True)

    idle = wait_idle(target, max(args.settle_s, 5.0))
    final = None
    peak = None
    back = None
    tolerance_kib = None
    if args.server_pid:
        tolerance_kib = max(args.rss_tolerance_mb * 1024, baseline * args.rss_tolerance_pct / 100.0)
        # Memory may take a moment to be handed back (freed sequences,
        # allocator trimming): poll until it is within tolerance or settle-s.
        deadline = time.time() + args.settle_s
        while True:
            final = rss_kib(args.server_pid)
            if final is None or final <= baseline + tolerance_kib or time.time() >= deadline:
                break
            time.sleep(0.5)
        sampler.stop_event.set()
        sampler.join()
        during = [v for _, v in sampler.samples]
        peak = max(during) if during else None
        back = final is not None and final <= baseline + tolerance_kib
    m_after = metrics(target)

    def delta(name):
        if name in m_after and name in m_before:
            return m_after[name] - m_before[name]
        return None

    report = {
        "tool": "scripts/load_test.py",
        "git_revision": sb.git_revision(),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "base_url": args.base_url,
        "model": model,
        "params": {k: getattr(args, k) for k in ("clients", "duration_s", "max_tokens", "prompt_words",
                                                  "disconnect_fraction", "warmup_s", "rss_tolerance_mb",
                                                  "rss_tolerance_pct", "settle_s", "seed")},
        "wall_s": wall,
        "requests_ok": counts["ok"],
        "requests_failed": counts["failed"],
        "requests_disconnected": counts["disconnected"],
        "requests_ok_during_load": counts["load_ok"],
        "completion_tokens": counts["completion_tokens"],
        "output_tok_s": counts["completion_tokens"] / wall if wall > 0 else None,
        "ttft_s": {"p50": sb.percentile(ttfts, 50), "p99": sb.percentile(ttfts, 99)},
        "itl_s": {"p50": sb.percentile(gaps, 50), "p99": sb.percentile(gaps, 99)},
        "finish_reasons": finish,
        "failure_samples": failures,
        "server_idle_after": idle,
        "rss_kib": {"cold": cold, "baseline": baseline, "peak": peak, "final": final, "tolerance": tolerance_kib,
                    "back_to_baseline": back,
                    "samples": sampler.samples if sampler else []},
        "server_metrics_delta": {k: delta(k) for k in (
            "lily_engine_requests_finished_total", "lily_engine_requests_cancelled_total",
            "lily_engine_requests_failed_total", "lily_client_disconnects_total", "lily_engine_failures_total",
            "lily_completion_tokens_total")},
        "server_after": {k: m_after.get(k) for k in (
            "lily_engine_running", "lily_engine_waiting", "lily_http_requests_in_flight",
            "lily_prefix_cache_entries", "lily_prefix_cache_held_tokens")},
    }
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")

    print(f"{args.clients} clients for {wall:.1f} s (after {args.warmup_s:g} s of warm-up): {counts['ok']} complete, {counts['failed']} failed, "
          f"{counts['disconnected']} disconnected on purpose; {counts['completion_tokens']} tokens "
          f"({report['output_tok_s']:.1f} tok/s)")
    ms = lambda v: "-" if v is None else f"{v * 1e3:.1f}"  # noqa: E731
    print(f"  TTFT p50 {ms(report['ttft_s']['p50'])} p99 {ms(report['ttft_s']['p99'])} ms, "
          f"ITL p50 {ms(report['itl_s']['p50'])} p99 {ms(report['itl_s']['p99'])} ms")
    for f_ in failures[:10]:
        print(f"  FAILED {f_}")
    if not idle:
        print("  server still had running or waiting requests after the load")
    if args.server_pid:
        mib = lambda k: "-" if k is None else f"{k / 1024:.1f} MiB"  # noqa: E731
        print(f"  server RSS: cold {mib(cold)}, baseline after warm-up {mib(baseline)}, peak {mib(peak)}, after {mib(final)} "
              f"(tolerance {mib(tolerance_kib)}): {'back to baseline' if back else 'NOT back to baseline'}")
    sa = report["server_after"]
    print(f"  after: running {sa['lily_engine_running']}, waiting {sa['lily_engine_waiting']}, prefix cache "
          f"{sa['lily_prefix_cache_entries']} entries / {sa['lily_prefix_cache_held_tokens']} tokens")
    ok = counts["failed"] == 0 and idle and (back is not False)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
