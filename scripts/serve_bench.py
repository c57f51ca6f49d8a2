#!/usr/bin/env python3
"""Serving benchmark of `lily serve` (docs/design.md §7.2, issue 5).

For each client count N (default 1, 8, 32, 64), N threads each send K
streaming chat requests one after another, all N starting together. Per
request it measures the time to first token (first delta with content,
reasoning or a tool call), the gaps between later token-bearing chunks
(inter-token latency; Lily sends one chunk per decoded token unless text is
held back, e.g. a possible stop string), and the completion tokens from the
usage chunk (`stream_options.include_usage`). Per N it reports aggregate
output tok/s = completion tokens of all requests / wall time of that phase,
TTFT and ITL p50/p99, and the number of failed requests, as a table and,
with --json, as JSON (with the git revision and the server's model card).

Prompts are unique per request (a distinct first line), so the prefix cache
cannot serve them; their length is calibrated to --prompt-tokens with one
untimed warm-up request, and the measured prompt tokens are reported.

Standard library only (threads + http.client + hand-parsed SSE), so it runs
on a machine without the openai or aiohttp packages. Loopback addresses only:
it refuses any other host.

    python3 scripts/serve_bench.py --base-url http://127.0.0.1:8000 \
        --clients 1,8,32,64 --requests-per-client 4 --max-tokens 128 \
        --prompt-tokens 256 --json bench.json

load_test.py reuses the request and SSE code from this file.
"""

import argparse
import http.client
import ipaddress
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
import urllib.parse

SCHEMA_VERSION = 1

# Common English words: almost all are one Qwen token with a leading space.
WORDS = (
    "the of and to in is was for on as with by at from that this it be are or an which have not had but were one all "
    "their has been more there can who its also new when two other time first after into only some these would many "
    "most over people years such then them where may used well while about between during city part state world"
).split()


class LoopbackError(ValueError):
    pass


def parse_base_url(base_url):
    """(host, port, path prefix) of an http:// loopback URL; refuses others."""
    u = urllib.parse.urlsplit(base_url)
    if u.scheme != "http":
        raise LoopbackError(f"only http:// URLs are supported, got {base_url!r}")
    host = u.hostname or ""
    if host != "localhost":
        try:
            addr = ipaddress.ip_address(host)
        except ValueError:
            raise LoopbackError(f"{host!r} is not a loopback address (use 127.0.0.1, ::1 or localhost)") from None
        if not addr.is_loopback:
            raise LoopbackError(f"{host} is not a loopback address: this tool only talks to a local server")
    port = u.port or 80
    prefix = u.path.rstrip("/")
    if prefix.endswith("/v1"):
        prefix = prefix[: -len("/v1")]
    return host, port, prefix


class Target:
    """Where the server is and how to call it."""

    def __init__(self, base_url, api_key=None, timeout=600.0):
        self.host, self.port, self.prefix = parse_base_url(base_url)
        self.api_key = api_key
        self.timeout = timeout

    def connect(self):
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)

    def headers(self):
        h = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def get_json(self, path):
        conn = self.connect()
        try:
            conn.request("GET", self.prefix + path, headers=self.headers())
            resp = conn.getresponse()
            body = resp.read()
            if resp.status != 200:
                raise RuntimeError(f"GET {path}: HTTP {resp.status}: {body[:300]!r}")
            return json.loads(body)
        finally:
            conn.close()

    def get_text(self, path):
        conn = self.connect()
        try:
            conn.request("GET", self.prefix + path, headers=self.headers())
            resp = conn.getresponse()
            return resp.status, resp.read().decode("utf-8", "replace")
        finally:
            conn.close()


class Result:
    """One streamed request, as measured and as checked."""

    __slots__ = (
        "ok", "error", "status", "ttft", "gaps", "start", "end", "chunks", "prompt_tokens",
        "completion_tokens", "cached_tokens", "finish_reason", "done", "disconnected", "text_chars",
    )

    def __init__(self):
        self.ok = False
        self.error = None
        self.status = None
        self.ttft = None
        self.gaps = []
        self.start = None
        self.end = None
        self.chunks = 0
        self.prompt_tokens = None
        self.completion_tokens = None
        self.cached_tokens = None
        self.finish_reason = None
        self.done = False
        self.disconnected = False
        self.text_chars = 0


def sse_events(resp):
    """(arrival time, data) for each SSE event of a streamed response; the
    time is taken when the event's last line arrives."""
    data = []
    while True:
        line = resp.readline()
        if not line:
            if data:
                yield time.perf_counter(), "\n".join(data)
            return
        now = time.perf_counter()
        line = line.decode("utf-8", "replace").rstrip("\r\n")
        if line == "":
            if data:
                yield now, "\n".join(data)
                data = []
            continue
        if line.startswith(":"):
            continue  # an SSE comment (keep-alive)
        field, _, value = line.partition(":")
        if field == "data":
            data.append(value[1:] if value.startswith(" ") else value)


def chat_body(model, prompt, max_tokens, thinking=True, temperature=None, seed=None):
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if not thinking:
        body["chat_template_kwargs"] = {"enable_thinking": False}
    if temperature is not None:
        body["temperature"] = temperature
    if seed is not None:
        body["seed"] = seed
    return body


def stream_chat(target, conn, body, disconnect_after=None):
    """Sends one streaming chat request on `conn` and reads it to the end.

    Checks what a complete OpenAI stream looks like: HTTP 200, every event is
    JSON without an `error`, exactly one chunk with a finish_reason (stop,
    length or tool_calls), then the usage chunk, then `[DONE]`, then nothing.
    With `disconnect_after` (a number of token chunks) the client hangs up
    early on purpose; such a result is marked `disconnected`, not failed.
    Returns (Result, whether `conn` can be reused).
    """
    r = Result()
    payload = json.dumps(body).encode()
    r.start = time.perf_counter()
    try:
        conn.request("POST", target.prefix + "/v1/chat/completions", body=payload, headers=target.headers())
        resp = conn.getresponse()
    except (OSError, http.client.HTTPException) as e:
        r.end = time.perf_counter()
        r.error = f"request failed: {type(e).__name__}: {e}"
        return r, False
    r.status = resp.status
    if resp.status != 200:
        text = resp.read()[:500].decode("utf-8", "replace")
        r.end = time.perf_counter()
        r.error = f"HTTP {resp.status}: {text}"
        return r, not resp.will_close
    last_token_time = None
    try:
        for t, data in sse_events(resp):
            if r.done:
                r.error = f"data after [DONE]: {data[:200]!r}"
                break
            if data == "[DONE]":
                r.done = True
                continue
            try:
                chunk = json.loads(data)
            except ValueError:
                r.error = f"event is not JSON: {data[:200]!r}"
                break
            if "error" in chunk:
                r.error = f"error event: {json.dumps(chunk['error'])[:300]}"
                break
            usage = chunk.get("usage")
            if usage:
                if r.finish_reason is None:
                    r.error = "usage chunk before the finish_reason chunk"
                    break
                r.prompt_tokens = usage.get("prompt_tokens")
                r.completion_tokens = usage.get("completion_tokens")
                r.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            for choice in chunk.get("choices") or []:
                if r.finish_reason is not None:
                    r.error = "a choice chunk after the finish_reason chunk"
                    break
                delta = choice.get("delta") or {}
                text = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
                if text or delta.get("tool_calls"):
                    r.chunks += 1
                    r.text_chars += len(text)
                    if last_token_time is None:
                        r.ttft = t - r.start
                    else:
                        r.gaps.append(t - last_token_time)
                    last_token_time = t
                if choice.get("finish_reason") is not None:
                    r.finish_reason = choice["finish_reason"]
            if r.error:
                break
            if disconnect_after is not None and r.chunks >= disconnect_after and r.finish_reason is None:
                r.disconnected = True
                break
    except (OSError, http.client.HTTPException, ValueError) as e:
        r.error = f"stream broken: {type(e).__name__}: {e}"
    r.end = time.perf_counter()
    if r.disconnected:
        conn.close()
        return r, False
    if r.error is None:
        if r.finish_reason is None:
            r.error = "truncated: the stream ended without a finish_reason chunk"
        elif r.finish_reason not in ("stop", "length", "tool_calls"):
            r.error = f"unexpected finish_reason {r.finish_reason!r}"
        elif r.completion_tokens is None:
            r.error = "truncated: no usage chunk"
        elif not r.done:
            r.error = "truncated: no [DONE]"
        elif body.get("max_tokens") is not None and r.completion_tokens > body["max_tokens"]:
            r.error = f"{r.completion_tokens} completion tokens for max_tokens {body['max_tokens']}"
    r.ok = r.error is None
    reusable = r.ok and not resp.will_close
    if not reusable:
        conn.close()
    return r, reusable


def percentile(values, q):
    """Linear-interpolated percentile (q in 0..100); None when empty."""
    if not values:
        return None
    v = sorted(values)
    if len(v) == 1:
        return v[0]
    pos = (len(v) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def make_prompt(rng, words, tag):
    body = " ".join(rng.choice(WORDS) for _ in range(max(words, 1)))
    return f"Request {tag}.\n{body}"


def model_id(target, requested):
    if requested:
        return requested, None
    models = target.get_json("/v1/models").get("data") or []
    if not models:
        raise RuntimeError("/v1/models lists no model")
    return models[0]["id"], models[0]


def calibrate_words(target, model, prompt_tokens, thinking):
    """Words per prompt so the rendered prompt has about `prompt_tokens`
    tokens, fitted from two untimed requests of different lengths (which
    also warm the server up)."""
    rng = random.Random(12345)
    points = []
    conn = target.connect()
    try:
        for words in (max(prompt_tokens // 2, 8), max(prompt_tokens, 16)):
            body = chat_body(model, make_prompt(rng, words, f"calibration-{words}"), 4, thinking)
            r, reusable = stream_chat(target, conn, body)
            if not r.ok or not r.prompt_tokens:
                raise RuntimeError(f"warm-up request failed: {r.error}")
            points.append((words, r.prompt_tokens))
            if not reusable:
                conn = target.connect()
    finally:
        conn.close()
    (w1, t1), (w2, t2) = points
    per_word = max((t2 - t1) / (w2 - w1), 0.1) if w2 != w1 else 1.0
    overhead = t1 - per_word * w1
    return max(int(round((prompt_tokens - overhead) / per_word)), 1)


def run_phase(target, model, n, per_client, max_tokens, words, thinking, temperature, seed_base):
    results = [[] for _ in range(n)]
    barrier = threading.Barrier(n + 1)

    def client(i):
        rng = random.Random(seed_base * 100003 + i)
        conn = target.connect()
        barrier.wait()
        for k in range(per_client):
            prompt = make_prompt(rng, words, f"{seed_base}-{i}-{k}-{rng.getrandbits(32):08x}")
            body = chat_body(model, prompt, max_tokens, thinking, temperature)
            r, reusable = stream_chat(target, conn, body)
            results[i].append(r)
            if not reusable:
                conn = target.connect()
        conn.close()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    flat = [r for rs in results for r in rs]
    ok = [r for r in flat if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    gaps = [g for r in ok for g in r.gaps]
    completion = sum(r.completion_tokens or 0 for r in ok)
    prompt = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    # Per-request decode rate after the first token.
    tpot = [(r.end - r.start - r.ttft) / (r.completion_tokens - 1) for r in ok
            if r.ttft is not None and r.completion_tokens and r.completion_tokens > 1]
    errors = [r.error for r in flat if not r.ok]
    return {
        "clients": n,
        "requests": len(flat),
        "errors": len(errors),
        "error_samples": sorted(set(errors))[:5],
        "wall_s": wall,
        "completion_tokens": completion,
        "prompt_tokens_mean": sum(prompt) / len(prompt) if prompt else None,
        "cached_tokens_total": sum(r.cached_tokens or 0 for r in ok),
        "agg_output_tok_s": completion / wall if wall > 0 else None,
        "ttft_s": {"p50": percentile(ttft, 50), "p90": percentile(ttft, 90), "p99": percentile(ttft, 99),
                   "mean": sum(ttft) / len(ttft) if ttft else None, "max": max(ttft) if ttft else None},
        "itl_s": {"p50": percentile(gaps, 50), "p90": percentile(gaps, 90), "p99": percentile(gaps, 99),
                  "samples": len(gaps)},
        "tpot_s_mean": sum(tpot) / len(tpot) if tpot else None,
        "finish_reasons": {k: sum(1 for r in ok if r.finish_reason == k) for k in sorted({r.finish_reason for r in ok})},
    }


def git_revision():
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=5)
        if rev.returncode == 0:
            return rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return None


def ms(x):
    return "-" if x is None else f"{x * 1000:.1f}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--clients", default="1,8,32,64", help="comma-separated client counts, one phase each")
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--api-key", default=os.environ.get("LILY_API_KEY"))
    ap.add_argument("--model", help="model id (default: the first of /v1/models)")
    ap.add_argument("--no-thinking", action="store_true", help="send enable_thinking: false")
    ap.add_argument("--temperature", type=float, default=None, help="default: the server's")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="socket timeout per request")
    ap.add_argument("--json", dest="json_out", help="write the results here")
    args = ap.parse_args(argv)
    try:
        clients = [int(x) for x in args.clients.split(",") if x.strip()]
        if not clients or min(clients) < 1:
            raise ValueError
    except ValueError:
        ap.error("--clients must be positive integers separated by commas")
    if args.requests_per_client < 1 or args.max_tokens < 1 or args.prompt_tokens < 1:
        ap.error("--requests-per-client, --max-tokens and --prompt-tokens must be at least 1")
    try:
        target = Target(args.base_url, args.api_key, args.timeout_s)
    except LoopbackError as e:
        print(f"serve_bench: {e}", file=sys.stderr)
        return 2
    try:
        model, card = model_id(target, args.model)
        words = calibrate_words(target, model, args.prompt_tokens, not args.no_thinking)
    except (OSError, RuntimeError, http.client.HTTPException, ValueError) as e:
        print(f"serve_bench: cannot reach a working server at {args.base_url}: {e}", file=sys.stderr)
        return 2

    phases = []
    print(f"model {model}; {args.requests_per_client} requests per client, max_tokens {args.max_tokens}, "
          f"~{args.prompt_tokens} prompt tokens", file=sys.stderr)
    header = f"{'N':>4} {'reqs':>5} {'agg tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'prompt':>7} {'errors':>6}"
    print(header)
    print("     " + " " * 17 + "(ms)      (ms)      (ms)     (ms)")
    for i, n in enumerate(clients):
        p = run_phase(target, model, n, args.requests_per_client, args.max_tokens, words,
                      not args.no_thinking, args.temperature, seed_base=i + 1)
        phases.append(p)
        pt = p["prompt_tokens_mean"]
        print(f"{n:>4} {p['requests']:>5} {p['agg_output_tok_s'] or 0:>10.1f} {ms(p['ttft_s']['p50']):>9} "
              f"{ms(p['ttft_s']['p99']):>9} {ms(p['itl_s']['p50']):>8} {ms(p['itl_s']['p99']):>8} "
              f"{'-' if pt is None else f'{pt:.0f}':>7} {p['errors']:>6}", flush=True)
        for e in p["error_samples"]:
            print(f"     error: {e}", file=sys.stderr)
    out = {
        "schema_version": SCHEMA_VERSION,
        "tool": "scripts/serve_bench.py",
        "git_revision": git_revision(),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": socket.gethostname(),
        "base_url": args.base_url,
        "model": model,
        "model_card": card,
        "params": {"clients": clients, "requests_per_client": args.requests_per_client,
                   "max_tokens": args.max_tokens, "prompt_tokens": args.prompt_tokens,
                   "prompt_words": words, "thinking": not args.no_thinking, "temperature": args.temperature},
        "phases": phases,
    }
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=2)
            f.write("\n")
    return 1 if any(p["errors"] for p in phases) else 0


if __name__ == "__main__":
    sys.exit(main())
