# Session 54, call 2 (any card; the contract on an H200 only; <10 min). Carries c54b.tar.xz (git-ignored; built with
# crates/cuda/scripts/ab-revisions.sh collect, stripped; each dir has a REVISION):
#   g54/main/{bench,lily,qmm_probe}   main (its kernels: 1d1802c9's; qmm_probe with the stage-math part variants 11-14)
#   g54/xpf0/bench                    s52-xpf0 (history 186: warp 0 of each dense qmm block of a 1-4-token step requests
#                                     x's lines into L1 after the dependency wait)
#   g54/resid/{bench,gpu_qmm,gpu_model}   s52-resid (history 187: the out-projections' residual rows read at a task's start)
#   g54/fr/{bench,gpu_kernels,gpu_model}  s53-fused-reduce (history 188: split launches of 2-4 splits on tiles of <=64
#                                     rows reduced by each tile's last split block)
#   g54/cr/bench                      s53-cluster-reduce (history 189, slower in call 1: its timelines here)
#   g54/cr4/bench                     s54-cr4 (189 with clusters only for launches of 2-4 splits, 188's launches)
#   run(command="bash docs/perf/2026-12-05-s54/devrun-19.sh", carry=["c54b.tar.xz"], kind="nvidia-h200")
# Every branch gives main's bits by construction, so its digests must equal main's.
# 1. steps at 1 / 2 / 4 / 8 and the 256-token prefill, main / xpf0 / resid, two interleaved rounds;
# 2. steps at 16 / 32 / 64 / 128 and the 256-token prefill, main / fr / cr4, two interleaved rounds;
# 3. on an H200: main's contract (`lily bench`, ten lengths, median of 2 rounds; the checkpoint written meanwhile);
# 4. resid's gpu_qmm and gpu_model, fr's gpu_kernels and gpu_model (LILY_REQUIRE_GPU=1);
# 5. timelines of the 256-token prefill and a 64-token step, main and cr (what the clusters cost, by kernel);
# 6. qmm_probe: on an H200 the stage-math parts at 1 / 8 / 64 tokens (history 184's question on this card); on another
#    card rings of 6 against the default and no math at 64 tokens.
set -u
R=$PWD; mkdir -p /tmp/c54b
tar xJf $R/c54b.tar.xz -C /tmp/c54b || { echo "tarball missing" | tee $OUT/summary.txt; exit 1; }
G=/tmp/c54b/g54; CK=/tmp/lily-full
O=$OUT/r19; mkdir -p $O; S=$OUT/summary.txt; export RUST_BACKTRACE=1
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "$GPU$(for b in main xpf0 resid fr cr cr4; do printf ' %s %s' $b $(cut -c1-8 $G/$b/REVISION); done)" | tee -a $S
H200=0; case "$GPU" in *H200*) H200=1; RAYON_NUM_THREADS=6 nice -n 19 $G/main/lily synth --preset full --out $CK > $O/synth.log 2>&1 & ;; esac
run_bench() { timeout 90 $2 --random-layers 40 --lengths 256 --batch $3 > $O/bench-$1.json 2>> $O/bench-err.txt || echo "bench $1 failed" | tee -a $S
  python3 -c "
import json,sys
rows=[json.loads(l) for l in open(sys.argv[1]) if l.startswith('{')]
p=[r for r in rows if 'prefill_tok_s' in r]; b=[r for r in rows if 'batch' in r]
print(sys.argv[2], ' '.join('p%d %.0f %s' % (r['prompt_tokens'], r['prefill_tok_s'], r['digest'][:6]) for r in p), ' '.join('b%d %.3f %s' % (r['batch'], r['step_ms'], r['seq0_digest'][:6]) for r in b))" $O/bench-$1.json $1 | tee -a $S; }
for r in 1 2; do for b in main xpf0 resid; do run_bench $b-s-$r $G/$b/bench 1,2,4,8; done; done
echo "short steps done at ${SECONDS}s" | tee -a $S
for r in 1 2; do for b in main fr cr4; do run_bench $b-l-$r $G/$b/bench 16,32,64,128; done; done
echo "long steps done at ${SECONDS}s" | tee -a $S
(cd $OUT && tar czf r19.tgz r19)
if [ $H200 = 1 ]; then
  wait
  tail -1 $O/synth.log | tee -a $S
  timeout 240 $G/main/lily bench --model $CK --out $O/contract-main.json --markdown $O/contract-main.md > $O/contract-main.txt 2>&1; echo "lily bench rc $? at ${SECONDS}s" | tee -a $S
  cat $O/contract-main.md 2>/dev/null | tee -a $S
  (cd $OUT && tar czf r19.tgz r19)
fi
for t in resid/gpu_qmm resid/gpu_model fr/gpu_kernels fr/gpu_model; do
  [ $SECONDS -lt 500 ] || { echo "$t not run (time)" | tee -a $S; continue; }
  l=$O/${t/\//-}.log; LILY_REQUIRE_GPU=1 timeout 120 $G/$t --test-threads=4 > $l 2>&1; echo "$t rc $?: $(grep -a 'test result' $l) at ${SECONDS}s" | tee -a $S
done
grep -a 'FAIL\|panicked' $O/*.log | head -8 | tee -a $S
(cd $OUT && tar czf r19.tgz r19)
L=$(find /usr/local -name 'libcupti.so*' 2>/dev/null | grep -v 'cu12\|/12\.' | head -3); TLP=$(for f in $L; do dirname $f; done | sort -u | tr '\n' ':')
for b in main cr; do
  [ $SECONDS -lt 540 ] && { LD_LIBRARY_PATH=$TLP${LD_LIBRARY_PATH:-} timeout 40 $G/$b/bench --random-layers 40 --lengths 256 --batch 64 --timeline > $O/timeline-$b.jsonl 2> $O/timeline-$b.err; grep -A10 'timeline of batch' $O/timeline-$b.err | tee -a $S; }
done
(cd $OUT && tar czf r19.tgz r19)
if [ $H200 = 1 ]; then
  [ $SECONDS -lt 550 ] && { timeout 40 $G/main/qmm_probe 1,8,64 0,2,11,12,13,14 > $O/qmm-probe-parts.txt 2>&1; grep -E "in_proj  |moe:" $O/qmm-probe-parts.txt | tee -a $S; }
else
  [ $SECONDS -lt 550 ] && { timeout 40 $G/main/qmm_probe 64 0,2,6 > $O/qmm-probe-rings.txt 2>&1; grep -E "device copy|moe:" $O/qmm-probe-rings.txt | tee -a $S; }
fi
(cd $OUT && tar czf r19.tgz r19)
