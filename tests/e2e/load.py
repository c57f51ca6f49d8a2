"""Bounded load test of `lily serve` on loopback (issue 6, item 6).

N streaming clients loop for a fixed time; each response is checked in
full: HTTP 200, the role chunk first, one finish_reason, the usage chunk,
`data: [DONE]` last, and completion tokens within max_tokens. Afterwards the
server must be idle (no request in flight, no sequence running) and its
resident memory, measured after a warm-up round, must not have grown beyond
a tolerance (the prefix cache fills during the warm-up; what grows after that
is a leak).

Used by test_load.py (a short run in CI) and from the command line:

    python3 tests/e2e/load.py --spawn --clients 64 --seconds 120
    python3 tests/e2e/load.py --base http://127.0.0.1:8000 --pid PID --clients 64 --seconds 120

Only loopback addresses are accepted as targets. Prints one JSON summary.
"""

import argparse
import http.client
import json
import random
import statistics
import threading
import time
from urllib.parse import urlparse

# Standard library only (http.client), so that it runs on a GPU host that
# has Python but not the test requirements.


def _conn(base, timeout):
    u = urlparse(base)
    return http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)


def http_get(base, path, headers=None, timeout=10):
    c = _conn(base, timeout)
    try:
        c.request("GET", path, headers=headers or {})
        r = c.getresponse()
        return r.status, r.read().decode("utf-8", "replace")
    finally:
        c.close()

MODEL = "lily"


def rss_bytes(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def metric(base, name, headers=None):
    _, text = http_get(base, "/metrics", headers)
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def one_request(base, rng, headers, max_tokens=None, gaps=None):
    """One streamed chat; returns (ok, reason, ttft_s, completion_tokens).
    `gaps` collects the times between text deltas (inter-token latency)."""
    max_tokens = max_tokens or rng.randint(4, 48)
    # Shared prefixes exercise the prefix cache; the suffix keeps prompts apart.
    topic = rng.choice(["weather", "history", "cooking", "rust"])
    messages = [
        {"role": "system", "content": f"You are a terse assistant about {topic}. " * 4},
        {"role": "user", "content": f"question {rng.randint(0, 10**9)}"},
    ]
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "chat_template_kwargs": {"enable_thinking": rng.random() < 0.5},
    }
    start = time.time()
    ttft = None
    last = start
    conn = _conn(base, 120)
    try:
        conn.request(
            "POST",
            "/v1/chat/completions",
            body=json.dumps(body),
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        r = conn.getresponse()
        if r.status != 200:
            return False, f"status {r.status}: {r.read()[:200]!r}", None, 0
        events = []
        for raw in r:
            line = raw.rstrip(b"\r\n")
            if not line:
                continue
            if not line.startswith(b"data: "):
                return False, f"bad SSE line {line[:80]!r}", None, 0
            data = line[6:]
            if data == b"[DONE]":
                events.append(None)
                break
            ev = json.loads(data)
            if "error" in ev:
                return False, f"error event {ev['error']}", None, 0
            if ev.get("choices"):
                d = ev["choices"][0]["delta"]
                if d.get("content") or d.get("reasoning_content"):
                    now = time.time()
                    if ttft is None:
                        ttft = now - start
                    elif gaps is not None:
                        gaps.append(now - last)
                    last = now
            events.append(ev)
    except (OSError, http.client.HTTPException, ValueError) as e:
        return False, f"transport: {e!r}", None, 0
    finally:
        conn.close()
    if not events or events[-1] is not None:
        return False, "truncated: no [DONE]", None, 0
    chunks = events[:-1]
    if chunks[0]["choices"][0]["delta"].get("role") != "assistant":
        return False, "first chunk without role", None, 0
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    if len(finishes) != 1 or finishes[0] not in ("stop", "length"):
        return False, f"finish reasons {finishes}", None, 0
    usage = chunks[-1].get("usage")
    if chunks[-1]["choices"] or not usage:
        return False, "no usage chunk", None, 0
    n = usage["completion_tokens"]
    if not 0 < n <= max_tokens:
        return False, f"completion_tokens {n} outside 1..{max_tokens}", None, 0
    return True, "", ttft, n


def percentile(sorted_values, q):
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * q))]


def run_load(base, clients, seconds, headers=None, seed=0, max_tokens=None):
    host = urlparse(base).hostname
    if host not in ("127.0.0.1", "localhost", "::1") and not host.startswith("127."):
        raise ValueError(f"load tests only target loopback, not {host}")
    stop_at = time.time() + seconds
    lock = threading.Lock()
    results = {"ok": 0, "failed": 0, "failures": [], "ttft": [], "gaps": [], "tokens": 0}

    def worker(i):
        rng = random.Random(seed * 1000 + i)
        while time.time() < stop_at:
            gaps = []
            ok, reason, ttft, n = one_request(base, rng, headers, max_tokens, gaps)
            with lock:
                results["gaps"].extend(gaps)
                if ok:
                    results["ok"] += 1
                    results["tokens"] += n
                    if ttft is not None:
                        results["ttft"].append(ttft)
                else:
                    results["failed"] += 1
                    if len(results["failures"]) < 10:
                        results["failures"].append(reason)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(clients)]
    t0 = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=seconds + 180)
    elapsed = time.time() - t0
    ttft = sorted(results.pop("ttft"))
    gaps = sorted(results.pop("gaps"))
    results["elapsed_s"] = round(elapsed, 1)
    results["clients"] = clients
    results["output_tok_per_s"] = round(results["tokens"] / elapsed, 1)
    if ttft:
        results["ttft_p50_s"] = round(statistics.median(ttft), 4)
        results["ttft_p99_s"] = round(percentile(ttft, 0.99), 4)
    if gaps:
        results["itl_p50_s"] = round(statistics.median(gaps), 5)
        results["itl_p99_s"] = round(percentile(gaps, 0.99), 5)
    return results


def wait_idle(base, headers=None, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if metric(base, "lily_http_requests_in_flight", headers) == 0 and metric(base, "lily_engine_running", headers) == 0:
            return True
        time.sleep(0.2)
    return False


def load_with_memory_check(base, pid, clients, seconds, warmup_s, headers=None):
    """Warm-up round, baseline RSS, main round, idle check, RSS again."""
    warm = run_load(base, clients, warmup_s, headers, seed=1)
    if not wait_idle(base, headers):
        raise AssertionError("server not idle after the warm-up")
    baseline = rss_bytes(pid)
    main = run_load(base, clients, seconds, headers, seed=2)
    idle = wait_idle(base, headers)
    after = rss_bytes(pid)
    return {
        "warmup": {k: warm[k] for k in ("ok", "failed")},
        "main": main,
        "idle_after": idle,
        "rss_baseline_mb": round(baseline / 1e6, 1),
        "rss_after_mb": round(after / 1e6, 1),
        "disconnects": metric(base, "lily_client_disconnects_total", headers),
    }


def memory_ok(report):
    """Resident memory after the main round is within the allocator's noise
    of the post-warm-up level: the high-water mark of concurrent buffers
    varies by tens of MB between rounds, a leak grows with the request count."""
    return report["rss_after_mb"] <= report["rss_baseline_mb"] * 1.3 + 32


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", help="server base URL (loopback)")
    ap.add_argument("--pid", type=int, help="server pid, for the memory check")
    ap.add_argument("--spawn", action="store_true", help="start `lily serve` ($LILY_BIN or target/debug/lily) with the demo checkpoint")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--warmup", type=float, default=10)
    ap.add_argument(
        "--bench",
        help="serving benchmark instead: comma-separated client counts (e.g. 1,8,32,64), "
        "each for --seconds with --max-tokens per request; no memory check",
    )
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--serve-arg", action="append", default=[], help="extra `lily serve` flag with --spawn (repeatable)")
    args = ap.parse_args()
    server = None
    if args.spawn:
        import tempfile
        from pathlib import Path

        from conftest import Server

        tmp = Path(tempfile.mkdtemp(prefix="lily-load-"))
        counts = [int(x) for x in args.bench.split(",")] if args.bench else [args.clients]
        serve_args = ["--max-concurrent", str(max(counts))] + [a for x in args.serve_arg for a in x.split()]
        server = Server("load", serve_args, tmp, tmp)
        base, pid = server.base, server.proc.pid
    else:
        if not args.base or not args.pid:
            ap.error("give --spawn, or --base and --pid")
        base, pid = args.base.rstrip("/"), args.pid
    try:
        if args.bench:
            run_load(base, 1, min(args.warmup, 10), max_tokens=8)  # warm-up
            report = {"bench": [run_load(base, int(n), args.seconds, seed=int(n), max_tokens=args.max_tokens)
                                for n in args.bench.split(",")]}
            print(json.dumps(report, indent=2))
            raise SystemExit(0 if all(r["failed"] == 0 for r in report["bench"]) else 1)
        report = load_with_memory_check(base, pid, args.clients, args.seconds, args.warmup)
    finally:
        if server:
            server.stop()
    print(json.dumps(report, indent=2))
    ok = report["main"]["failed"] == 0 and report["idle_after"] and memory_ok(report)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
