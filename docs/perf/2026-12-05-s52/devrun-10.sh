# Session 52, call 10: overlap_probe (main + crates/cuda/examples/overlap_probe.rs): a prefill pass on a second
# stream while decode steps go on, against the engine's order today; 64 sequences with passes of 8 and 16 prompts
# of 256 tokens, and 8 sequences with passes of 8.
#   run(command="bash docs/perf/2026-12-05-s52/devrun-10.sh", carry=["c52d.tar.xz"])
set -u
R=$PWD; mkdir -p /tmp/c52d && tar xJf $R/c52d.tar.xz -C /tmp/c52d
O=$OUT/r10; mkdir -p $O; S=$OUT/summary.txt; export RUST_BACKTRACE=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $S
for cfg in "64 8" "64 16" "8 8" "64 8"; do set -- $cfg
  timeout 120 /tmp/c52d/ov/overlap_probe --batch $1 --parts $2 --passes 6 >> $O/overlap.jsonl 2>> $O/overlap.err || echo "overlap $cfg failed" | tee -a $S
  tail -1 $O/overlap.jsonl | tee -a $S
done
tail -5 $O/overlap.err | tee -a $S
