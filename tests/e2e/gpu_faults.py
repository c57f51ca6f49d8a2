"""GPU memory running out inside a request, end to end (issue 6, item 5).

On the CUDA backend the only device memory a request takes while it runs is
KV-cache blocks from one pool shared by every sequence (and by the prefix
cache's snapshots). This script starts `lily serve --device cuda` with a pool
sized for one context of --max-seq tokens, then runs two streaming requests
whose contexts together outgrow it:

- A (older): a long prompt and max_tokens such that A alone fits;
- B (younger): started once A streams, also fitting alone.

Expected: the engine first gives back prefix-cache snapshots, then fails
exactly B, mid-stream, with an error event saying the KV cache is full; A
streams to its full max_tokens; a request sent afterwards is answered; the
server is idle with no sequence left and its failure counter is 1.

With --pressure-seconds, then many clients with long prompts keep the pool
short: every response must be complete or end with that error, nothing
else, and afterwards a request needing nearly the whole pool succeeds (no
KV block was lost). Last, SIGTERM must stop the server with exit status 0.

Standard library only, so that it runs on the GPU host:

    python3 tests/e2e/gpu_faults.py --bin .carry/lily --model /tmp/full

Prints one JSON report; exit status 0 when every expectation held.
"""

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load import _conn, http_get, metric  # noqa: E402

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
    conn = _conn(base, 600)
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
            if http_get(base, "/health", timeout=2)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server not ready in time")


def exhaust(base, model, ms, check, report):
    """Two requests outgrow the pool: the younger fails, the older finishes,
    the next request is served."""
    # About 0.6 and 0.35 of the context in prompt (these words take about
    # 1.08 tokens each with the template); each alone fits with its
    # max_tokens, together they outgrow the pool.
    a, b = {}, {}
    a_started = threading.Event()
    ta = threading.Thread(target=stream_chat, args=(base, model, prompt_text(ms * 55 // 100, 1), ms * 3 // 10, a, a_started))
    ta.start()
    check(a_started.wait(300), "A streams")
    tb = threading.Thread(target=stream_chat, args=(base, model, prompt_text(ms * 32 // 100, 2), ms * 3 // 10, b))
    tb.start()
    ta.join(600)
    tb.join(600)
    report["A"], report["B"] = a, b
    b_err = json.dumps(b.get("error"))
    check(a.get("finish") == "length" and a.get("done") and a.get("usage") and a["usage"]["completion_tokens"] == ms * 3 // 10,
          "A (older) streams to its full max_tokens and ends with [DONE]")
    check(b.get("status") == 200 and b.get("chunks", 0) > 0, "B was accepted and streamed before memory ran out")
    check(b.get("error") is not None and "KV cache full" in b_err, "B (younger) ends with an error event naming the KV cache")
    c = {}
    stream_chat(base, model, "Say something short.", 16, c)
    report["C"] = c
    check(c.get("finish") in ("length", "stop") and c.get("done"), "a request after the failure is answered in full")
    time.sleep(0.5)
    report["metrics"] = {k: metric(base, k) for k in (
        "lily_engine_running", "lily_http_requests_in_flight", "lily_engine_requests_failed_total",
        "lily_prefix_cache_evictions_total")}
    check(report["metrics"]["lily_engine_running"] == 0 and report["metrics"]["lily_http_requests_in_flight"] == 0,
          "idle afterwards: no sequence running, no request in flight")
    check(report["metrics"]["lily_engine_requests_failed_total"] == 1, "exactly one request failed")


def pressure(base, model, ms, seconds, clients, check, report):
    """Many clients with long prompts keep the pool short for `seconds`:
    every response must be complete or end with the out-of-memory error,
    nothing else; afterwards one request needing nearly the whole pool must
    succeed (no KV block was lost)."""
    stop_at = time.time() + seconds
    lock = threading.Lock()
    tally = {"complete": 0, "out_of_memory": 0, "other": 0, "samples": []}

    def worker(i):
        rng = random.Random(100 + i)
        while time.time() < stop_at:
            rec = {}
            words = rng.randint(ms // 40, ms * 35 // 100)
            stream_chat(base, model, prompt_text(words, rng.randrange(10**9)), rng.randint(32, ms // 16), rec)
            complete = rec.get("finish") in ("length", "stop") and rec.get("done") and rec.get("usage")
            oom = rec.get("error") is not None and "KV cache full" in json.dumps(rec.get("error"))
            kind = "complete" if complete else "out_of_memory" if oom else "other"
            with lock:
                tally[kind] += 1
                if kind == "other" and len(tally["samples"]) < 5:
                    tally["samples"].append(rec)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 600)
    report["pressure"] = tally
    check(tally["complete"] > 0 and tally["out_of_memory"] > 0,
          f"under pressure both complete answers and out-of-memory failures occur ({tally['complete']} / {tally['out_of_memory']})")
    check(tally["other"] == 0, f"no other outcome (transport error, truncation, other error): {tally['other']}")
    time.sleep(0.5)
    check(metric(base, "lily_engine_running") == 0 and metric(base, "lily_http_requests_in_flight") == 0,
          "idle after the pressure run")
    big = {}
    stream_chat(base, model, prompt_text(ms * 85 // 100, 7), ms // 20, big)
    report["big_after_pressure"] = {k: big.get(k) for k in ("status", "finish", "usage", "error")}
    check(big.get("finish") == "length" and big.get("done"),
          "afterwards a request needing nearly the whole pool succeeds (every KV block came back)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--max-seq", type=int, default=8192)
    ap.add_argument("--pressure-seconds", type=float, default=0, help="then the pressure scenario for this long (0: skip)")
    ap.add_argument("--pressure-clients", type=int, default=16)
    ap.add_argument("--log", default="gpu_faults_server.log")
    args = ap.parse_args()
    base = f"http://127.0.0.1:{args.port}"
    model = "lily-faults"
    cmd = [args.bin, "serve", "--model", args.model, "--device", "cuda", "--bind", f"127.0.0.1:{args.port}",
           "--max-seq", str(args.max_seq), "--max-concurrent", str(max(4, args.pressure_clients)),
           "--served-model-name", model]
    log = open(args.log, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    report = {"command": " ".join(cmd)}
    checks = []

    def check(ok, what):
        checks.append({"ok": bool(ok), "what": what})

    try:
        wait_ready(base, proc, 600)
        exhaust(base, model, args.max_seq, check, report)
        if args.pressure_seconds > 0:
            pressure(base, model, args.max_seq, args.pressure_seconds, args.pressure_clients, check, report)
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
