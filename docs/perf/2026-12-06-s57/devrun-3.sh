# Session 57, call 3 (any card, ~8 min): devrun-2.sh on c57b.tar.xz (g57/b2: s57-grouped-qmm at 827fec1b, x staged
# in shared memory by plain loads), results in r3:
#   run(command="bash docs/perf/2026-12-06-s57/devrun-3.sh", carry=["c57b.tar.xz"])
exec bash docs/perf/2026-12-06-s57/devrun-2.sh c57b.tar.xz g57/b2 r3 1
