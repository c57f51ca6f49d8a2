"""A short version of the bounded load test (tests/e2e/load.py) for CI:
16 streaming clients for 8 s against the real server (demo checkpoint), after
a 4 s warm-up. Zero failed or truncated responses, the server idle afterwards
(no request in flight, no sequence held), and resident memory back within
noise of its post-warm-up level. The 64-client, 2-minute run is
`python3 tests/e2e/load.py --spawn --clients 64 --seconds 120`.
"""

from load import load_with_memory_check, memory_ok


def test_short_load(main_server):
    report = load_with_memory_check(main_server.base, main_server.proc.pid, clients=16, seconds=8, warmup_s=4)
    print(report)
    main = report["main"]
    assert main["failed"] == 0, main["failures"]
    assert main["ok"] >= 16
    assert report["idle_after"]
    assert memory_ok(report), report
