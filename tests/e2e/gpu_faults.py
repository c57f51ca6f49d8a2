"""GPU memory running out inside requests, end to end (issue 6, item 5).

On the CUDA backend the only device memory a request takes while it runs is
KV-cache blocks from one pool shared by every sequence (and by the prefix
cache's snapshots). This script starts `lily serve --device cuda` with a
context of --max-seq tokens and a pool of --kv-cache-tokens (default half a
context), then:

1. preempt: two streaming requests that each fit the pool but together
   outgrow it while generating. The younger must pause (its sequence freed)
   and resume once the older is done; both stream to their full max_tokens,
   nothing fails, the preemption counter moves.
2. too big: a request whose prompt + max_tokens fits the context but not the
   pool, beside a small one. It must fail alone, mid-stream, with an error
   event saying the KV cache is full; the small one and the next request
   are answered in full.
3. pressure (--pressure-seconds): many clients with long prompts, each
   fitting the pool alone, keep it short: every response must be complete
   (requests wait or pause, none fails), and afterwards a request needing
   nearly the whole pool succeeds (no KV block was lost).

Last, the server must be idle and SIGTERM must stop it with exit status 0.
Standard library only, so that it runs on the GPU host, with a `lily`
binary built on a development machine and copied into gpu-bin/ (docs/gpu.md):

    python3 tests/e2e/gpu_faults.py --bin gpu-bin/lily --model /tmp/lily-full

Prints one JSON report; exit status 0 when every expectation held.
"""

import argparse
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import load_test  # noqa: E402  (the /metrics reader)
import serve_bench  # noqa: E402  (loopback-only HTTP target)


def metric(base, name):
    return load_test.metrics(serve_bench.Target(base))[name]

WORDS = "river stone cloud maple harbor lantern copper meadow violet thunder orbit canyon".split()


def prompt_text(words, seed):
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def stream_chat(base, model, text, max_tokens, record, started=None):
    """Streams one chat and fills `record`: status, tokens seen, the finish
    reason, usage, or the error event."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "chat_template_kwargs": {"enable_thinking": False},
    }
    record.update(chunks=0, finish=None, usage=None, error=None, done=False)
    conn = serve_bench.Target(base, timeout=600).connect()
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        record["status"] = r.status
        if r.status != 200:
            record["error"] = r.read().decode("utf-8", "replace")[:300]
            return
        for raw in r:
            line = raw.rstrip(b"\r\n")
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                record["done"] = True
                break
            ev = json.loads(data)
            if "error" in ev:
                record["error"] = ev["error"]
                break
            if ev.get("usage"):
                record["usage"] = ev["usage"]
            for c in ev.get("choices") or []:
                if c["delta"].get("content") or c["delta"].get("reasoning_content"):
                    record["chunks"] += 1
                    if started is not None:
                        started.set()
                if c.get("finish_reason"):
                    record["finish"] = c["finish_reason"]
    except Exception as e:  # transport failures are results here, not crashes
        record["error"] = f"transport: {e!r}"
    finally:
        conn.close()


def wait_ready(base, proc, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            if serve_bench.Target(base, timeout=2).get_text("/health")[0] == 200:
                return
        except (OSError, http.client.HTTPException):
            pass
        time.sleep(0.5)
    raise RuntimeError("server not ready in time")


def complete(rec, max_tokens=None):
    ok = rec.get("finish") in ("length", "stop") and rec.get("done") and rec.get("usage")
    return bool(ok) and (max_tokens is None or rec["usage"]["completion_tokens"] == max_tokens)


def words_for(tokens):
    """Words of prompt_text for about `tokens` prompt tokens (1.08 tokens a
    word with the chat template, measured with the Qwen tokenizer)."""
    return int(tokens / 1.08)


def in_parallel(*jobs):
    threads = [threading.Thread(target=stream_chat, args=job) for job in jobs]
    for t in threads:
        t.start()
        time.sleep(1.0)  # admission order = age
    for t in threads:
        t.join(900)


def preempt(base, model, pool, check, report):
    """Each fits the pool alone, together they outgrow it while generating."""
    a, b = {}, {}
    before = metric(base, "lily_engine_preemptions_total")
    max_tokens = pool * 22 // 100
    in_parallel((base, model, prompt_text(words_for(pool * 40 // 100), 1), max_tokens, a),
                (base, model, prompt_text(words_for(pool * 32 // 100), 2), max_tokens, b))
    report["preempt"] = {"A": a, "B": b, "preemptions": metric(base, "lily_engine_preemptions_total") - before}
    check(complete(a, max_tokens), "preempt: A (older) streams to its full max_tokens")
    check(complete(b, max_tokens), "preempt: B (younger) also streams to its full max_tokens")
    check(report["preempt"]["preemptions"] >= 1, "preempt: the younger was paused to give its KV memory to the older")
    check(metric(base, "lily_engine_requests_failed_total") == 0, "preempt: nothing failed")


def too_big(base, model, pool, ms, check, report):
    """Fits the context, not the pool: fails alone, mid-stream."""
    big, small, after = {}, {}, {}
    in_parallel((base, model, prompt_text(words_for(pool // 2), 3), min(ms - pool // 2 - 64, pool), big),
                (base, model, "Count slowly.", 200, small))
    stream_chat(base, model, "Say something short.", 16, after)
    report["too_big"] = {"big": big, "small": small, "after": after}
    check(big.get("status") == 200 and big.get("chunks", 0) > 0, "too big: accepted and streamed until the pool ran out")
    check(big.get("error") is not None and "KV cache full" in json.dumps(big.get("error")),
          "too big: ends with an error event naming the KV cache")
    check(complete(small, 200), "too big: the small request beside it is answered in full")
    check(complete(after, 16), "too big: the next request is answered in full")
    check(metric(base, "lily_engine_requests_failed_total") == 1, "too big: exactly one request failed")


def pressure(base, model, pool, seconds, clients, check, report):
    """Many clients, each fitting the pool alone, keep it short for
    `seconds`: every response complete; afterwards a request needing nearly
    the whole pool succeeds (no KV block was lost)."""
    stop_at = time.time() + seconds
    lock = threading.Lock()
    tally = {"complete": 0, "other": 0, "samples": []}
    before = metric(base, "lily_engine_preemptions_total")

    def worker(i):
        rng = random.Random(100 + i)
        while time.time() < stop_at:
            rec = {}
            words = rng.randint(words_for(pool // 40), words_for(pool * 30 // 100))
            stream_chat(base, model, prompt_text(words, rng.randrange(10**9)), rng.randint(32, pool // 8), rec)
            with lock:
                if complete(rec):
                    tally["complete"] += 1
                else:
                    tally["other"] += 1
                    if len(tally["samples"]) < 5:
                        tally["samples"].append(rec)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 900)
    tally["preemptions"] = metric(base, "lily_engine_preemptions_total") - before
    report["pressure"] = tally
    check(tally["complete"] > 0 and tally["other"] == 0,
          f"pressure: every response complete ({tally['complete']} complete, {tally['other']} not)")
    time.sleep(0.5)
    check(metric(base, "lily_engine_running") == 0 and metric(base, "lily_http_requests_in_flight") == 0,
          "pressure: idle afterwards")
    big = {}
    stream_chat(base, model, prompt_text(words_for(pool * 80 // 100), 7), pool // 16, big)
    report["big_after_pressure"] = {k: big.get(k) for k in ("status", "finish", "usage", "error")}
    check(complete(big, pool // 16), "pressure: then a request needing nearly the whole pool succeeds (every KV block came back)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--max-seq", type=int, default=8192)
    ap.add_argument("--kv-cache-tokens", type=int, help="KV pool (default: half of --max-seq)")
    ap.add_argument("--pressure-seconds", type=float, default=0, help="then the pressure scenario for this long (0: skip)")
    ap.add_argument("--pressure-clients", type=int, default=16)
    ap.add_argument("--log", default="gpu_faults_server.log")
    args = ap.parse_args()
    base = f"http://127.0.0.1:{args.port}"
    model = "lily-faults"
    pool = args.kv_cache_tokens or args.max_seq // 2
    cmd = [args.bin, "serve", "--model", args.model, "--device", "cuda", "--bind", f"127.0.0.1:{args.port}",
           "--max-seq", str(args.max_seq), "--kv-cache-tokens", str(pool),
           "--max-concurrent", str(max(4, args.pressure_clients)), "--served-model-name", model]
    log = open(args.log, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    report = {"command": " ".join(cmd)}
    checks = []

    def check(ok, what):
        checks.append({"ok": bool(ok), "what": what})

    try:
        wait_ready(base, proc, 600)
        preempt(base, model, pool, check, report)
        too_big(base, model, pool, args.max_seq, check, report)
        if args.pressure_seconds > 0:
            pressure(base, model, pool, args.pressure_seconds, args.pressure_clients, check, report)
        report["metrics"] = {k: metric(base, k) for k in (
            "lily_engine_running", "lily_http_requests_in_flight", "lily_engine_requests_failed_total",
            "lily_engine_preemptions_total", "lily_prefix_cache_evictions_total",
            "lily_kv_cache_free_tokens", "lily_kv_cache_total_tokens")}
    except Exception as e:
        check(False, f"scenario raised {e!r}")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "killed after 120 s"
        log.close()
        report["exit_status"] = rc
        check(rc == 0, "SIGTERM stops the server with status 0")
    report["checks"] = checks
    report["ok"] = all(c["ok"] for c in checks)
    print(json.dumps(report, indent=2))
    raise SystemExit(0 if report["ok"] else 1)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
