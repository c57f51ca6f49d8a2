# Session 57, call 4 (any card, ~2 min): devrun-2.sh on c57c.tar.xz (g57/b3: s57-grouped-qmm at 1a351b6b, x staged
# by cp.async), results in r4; gpu_model left out (the digests show the bits of call 3):
#   run(command="bash docs/perf/2026-12-06-s57/devrun-4.sh", carry=["c57c.tar.xz"])
exec bash docs/perf/2026-12-06-s57/devrun-2.sh c57c.tar.xz g57/b3 r4 0
