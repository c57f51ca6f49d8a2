# Session 47's prepared calls for the next lease, 1 of 3 (no device in sessions 46-47).
# Binaries (the development machine; /work/lease-next/bins may still hold them, check the revisions in
# /work/lease-next/build.log against main), ~10 min:
#   git branch -f served-graph-next main && git worktree add /tmp/sg served-graph-next &&
#     (cd /tmp/sg && git revert --no-edit d60eb67b) && git worktree remove /tmp/sg   # re-applies served-graph
#   TESTS="gpu_runahead gpu_sampling gpu_model gpu_qmm" LILY=1 bash crates/cuda/scripts/ab-revisions.sh \
#     collect /work/lease-next/bins served-graph-next main
#   cargo build -p lily-cuda --release --example qmm_probe        # main's qmm.cu is served-graph-next's
#   git worktree add --detach /tmp/old a090f5cd && (cd /tmp/old && cargo build --release -p lily-cuda --example bench) &&
#     mkdir -p /work/lease-next/old && cp $CARGO_TARGET_DIR/release/examples/bench /work/lease-next/old/ && strip /work/lease-next/old/bench &&
#     git worktree remove --force /tmp/old   # main before session 47 (its hi/lo kernels' registers moved, their opcodes did not)
#   mkdir -p /tmp/pk/main /tmp/pk/base /tmp/pk/old && cp /work/lease-next/bins/served-graph-next/{bench,gpu_runahead,gpu_sampling,gpu_model,gpu_qmm,lily} /tmp/pk/main/ &&
#     cp $CARGO_TARGET_DIR/release/examples/qmm_probe /tmp/pk/main/ && strip /tmp/pk/main/qmm_probe &&
#     cp /work/lease-next/bins/main/lily /tmp/pk/base/ && cp /work/lease-next/old/bench /tmp/pk/old/ &&
#     cd /tmp/pk && tar cJf c1.tar.xz main/gpu_* main/qmm_probe && tar cJf c2.tar.xz main/bench old/bench main/lily &&
#     tar cJf c3.tar.xz main/lily base/lily   # one per call: a call carries at most 64 MiB with the checkout and .git
#   (into the checkout root; add c1.tar.xz, c2.tar.xz, c3.tar.xz and .synth-full/ to .git/info/exclude)
#   run(command="bash docs/perf/2026-12-05-s47/devrun-1.sh", carry=["c1.tar.xz"])   ~7 min
# Call 1 runs the merged code's (served-graph on main, which holds the fp16 dense inputs, history 160)
# suites with LILY_REQUIRE_GPU=1: gpu_qmm (the fp16 kernels against the f64 reference on the packed
# halves), gpu_model (the fp16 path against each sequence alone, beside the GEMM path), gpu_runahead and
# gpu_sampling (served-graph); then qmm_probe's dense rows at 1, 4, 5, 8, 12, 16 tokens, hi/lo and fp16, and
# at 8 tokens with rings of 2 and of 6.
# If the suites pass: `git revert d60eb67b` on main (served-graph), and call 2.
set -u
R=$PWD; mkdir -p /tmp/b && for t in $R/binsnext.tar.xz $R/c[123].tar.xz; do [ -f $t ] && tar xJf $t -C /tmp/b; done; O=$OUT/c1; mkdir -p $O
export RUST_BACKTRACE=1; B=/tmp/b/main
for s in gpu_qmm gpu_model gpu_runahead gpu_sampling; do
  LILY_REQUIRE_GPU=1 timeout 170 $B/$s --test-threads=2 --nocapture > $O/$s.log 2>&1
  echo "$s rc $?: $(grep 'test result' $O/$s.log)"
done
grep -h -a 'fp16\|qmm on fp16\|GEMM decode path: batch' $O/gpu_qmm.log $O/gpu_model.log | cut -c1-220 | head -20
timeout 120 $B/qmm_probe 1,4,5,8,12,16 0 > $O/qmm_probe.txt 2>&1 || echo "qmm_probe rc $?"
grep -v 'moe:' $O/qmm_probe.txt | cut -c1-120
# The rings at 8 tokens (rings of 2 / of 6 for every matrix kernel): the fp16 entries read half the x
# bytes of the hi/lo ones, so their best ring may differ (history 129 set the lm_head's to 2 for L1).
timeout 80 $B/qmm_probe 8 5,6 > $O/qmm_probe-rings.txt 2>&1 || echo "qmm_probe rings rc $?"
grep -v 'moe:' $O/qmm_probe-rings.txt | grep 'n=8' | cut -c1-120
