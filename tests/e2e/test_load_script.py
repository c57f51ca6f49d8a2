"""CI run of scripts/load_test.py against the real `lily serve` (issue 6, item 6).

The same script makes the full and the H200 runs; here it also has clients
that hang up mid-stream. Its own server on the demo checkpoint
(so earlier tests do not move its memory baseline), 16 streaming clients for
20 seconds, one request in ten hung up on purpose after a few tokens. Every
other response must be complete (finish_reason chunk, usage, [DONE]), none
may fail, the server must end idle, and its resident memory must come back
to within max(64 MiB, 10%) of the baseline taken after 5 s of the same
load (load_test.py's docstring says why the baseline is a warm one). The full
version is `python3 scripts/load_test.py --clients 64 --duration-s 120
--server-pid PID` against a release build.

It also runs scripts/serve_bench.py briefly (1 and 4 clients, a few short
requests) so the serving benchmark keeps working; its figures mean nothing
on a shared CI machine and are not checked, only its completeness checks.
"""

import json
import subprocess
import sys

from conftest import REPO, Server


def test_serve_bench_script_runs(main_server, tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "serve_bench.py"),
            "--base-url", main_server.base,
            "--clients", "1,4",
            "--requests-per-client", "2",
            "--max-tokens", "8",
            "--prompt-tokens", "64",
            "--json", str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    report = json.loads(out.read_text())
    assert [p["clients"] for p in report["phases"]] == [1, 4]
    for p in report["phases"]:
        assert p["errors"] == 0 and p["requests"] == 2 * p["clients"], p
        assert 0 < p["completion_tokens"] <= 8 * p["requests"], p
        assert p["ttft_s"]["p50"] is not None and p["agg_output_tok_s"] > 0, p
    # Loopback only: any other host is refused before a request is sent.
    refused = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "serve_bench.py"), "--base-url", "http://192.0.2.1:80"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2 and "loopback" in refused.stderr, refused.stderr


def test_load_script_sixteen_clients_twenty_seconds(cache_dir, log_dir, tmp_path):
    server = Server("load", [], cache_dir, log_dir)
    report_path = tmp_path / "load.json"
    try:
        proc = subprocess.run(
            [
                sys.executable,
                str(REPO / "scripts" / "load_test.py"),
                "--base-url", server.base,
                "--clients", "16",
                "--duration-s", "20",
                "--warmup-s", "5",
                "--max-tokens", "48",
                "--disconnect-fraction", "0.1",
                "--server-pid", str(server.proc.pid),
                "--json", str(report_path),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert server.proc.poll() is None, f"the server died under load:\n{server.log_text()[-3000:]}"
    finally:
        server.stop()
    assert report_path.exists(), f"no report; exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    report = json.loads(report_path.read_text())
    summary = f"{proc.stdout}\n{proc.stderr}"
    assert report["requests_failed"] == 0, summary
    assert report["requests_ok"] >= 16, summary
    assert report["server_idle_after"], summary
    assert report["rss_kib"]["back_to_baseline"] is True, summary
    assert report["server_after"]["lily_engine_running"] == 0, summary
    assert report["server_metrics_delta"]["lily_engine_failures_total"] == 0, summary
    # Latencies of the load's complete requests (what mixed steps and the
    # prefill budget trade against each other).
    ttft, itl = report["ttft_s"], report["itl_s"]
    assert ttft["p50"] is not None and 0 < ttft["p50"] <= ttft["p99"], summary
    assert itl["p50"] is not None and 0 < itl["p50"] <= itl["p99"], summary
    assert proc.returncode == 0, summary
    assert "panicked" not in server.log_path.read_text(errors="replace")
