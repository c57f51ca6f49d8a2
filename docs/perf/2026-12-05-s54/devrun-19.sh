# Session 54, call 2 (any card; the contract part on an H200 only; <10 min): session 52's devrun-15.sh on fresh builds.
# Histories 186 (branch s52-xpf0 da7ca767: after the dependency wait, warp 0 of each dense qmm block of a 1-4-token step
# requests x's lines into L1) and 187 (branch s52-resid 9d70d9b4: the out-projections' residual rows read when a task
# starts) against main; the same bits, so the digests must agree. Carries c54b.tar.xz (git-ignored; ab-revisions.sh
# collect, stripped; each dir has a REVISION):
#   g54/main/{bench,lily,qmm_probe}   main (its kernels: 1d1802c9's; qmm_probe with the stage-math part variants 11-14)
#   g54/xpf0/bench                    s52-xpf0
#   g54/resid/{bench,gpu_qmm,gpu_model}   s52-resid
#   run(command="bash docs/perf/2026-12-05-s54/devrun-19.sh", carry=["c54b.tar.xz"], kind="nvidia-h200")
# 1. steps at 1 / 2 / 4 / 8 and the 256-token prefill, main / xpf0 / resid, two interleaved rounds; resid's gpu_qmm and
#    gpu_model (LILY_REQUIRE_GPU=1);
# 2. on an H200: main's contract (`lily bench`, ten lengths, median of 2 rounds: the JSON issues 11 and 12 ask for) and
#    the stage-math parts probe at 1 / 8 / 64 tokens (history 184's question on this card); on another card: qmm_probe
#    at 64 tokens with rings of 6 against the default and no math (session 53's devrun-16 step 3).
set -u
R=$PWD; mkdir -p /tmp/c54b
tar xJf $R/c54b.tar.xz -C /tmp/c54b || { echo "tarball missing" | tee $OUT/summary.txt; exit 1; }
G=/tmp/c54b/g54; CK=/tmp/lily-full
O=$OUT/r19; mkdir -p $O; S=$OUT/summary.txt; export RUST_BACKTRACE=1
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "$GPU main $(cut -c1-8 $G/main/REVISION) xpf0 $(cut -c1-8 $G/xpf0/REVISION) resid $(cut -c1-8 $G/resid/REVISION)" | tee -a $S
case "$GPU" in *H200*) RAYON_NUM_THREADS=6 nice -n 19 $G/main/lily synth --preset full --out $CK > $O/synth.log 2>&1 & ;; esac
run_bench() { timeout 90 $2 --random-layers 40 --lengths 256 --batch 1,2,4,8 > $O/bench-$1.json 2>> $O/bench-err.txt || echo "bench $1 failed" | tee -a $S
  python3 -c "
import json,sys
rows=[json.loads(l) for l in open(sys.argv[1]) if l.startswith('{')]
p=[r for r in rows if 'prefill_tok_s' in r]; b=[r for r in rows if 'batch' in r]
print(sys.argv[2], ' '.join('p%d %.0f d %.1f %s' % (r['prompt_tokens'], r['prefill_tok_s'], r.get('decode_tok_s', 0), r['digest'][:6]) for r in p), ' '.join('b%d %.3f %s' % (r['batch'], r['step_ms'], r['seq0_digest'][:6]) for r in b))" $O/bench-$1.json $1 | tee -a $S; }
for r in 1 2; do run_bench main-$r $G/main/bench; run_bench xpf0-$r $G/xpf0/bench; run_bench resid-$r $G/resid/bench; echo "round $r at ${SECONDS}s" | tee -a $S; done
(cd $OUT && tar czf r19.tgz r19)
LILY_REQUIRE_GPU=1 timeout 150 $G/resid/gpu_qmm --test-threads=4 > $O/gpu_qmm.log 2>&1; echo "resid gpu_qmm rc $?: $(grep -a 'test result' $O/gpu_qmm.log) at ${SECONDS}s" | tee -a $S
LILY_REQUIRE_GPU=1 timeout 120 $G/resid/gpu_model --test-threads=2 > $O/gpu_model.log 2>&1; echo "resid gpu_model rc $?: $(grep -a 'test result' $O/gpu_model.log) at ${SECONDS}s" | tee -a $S
grep -a 'FAIL\|panicked' $O/gpu_qmm.log $O/gpu_model.log | head -8 | tee -a $S
(cd $OUT && tar czf r19.tgz r19)
case "$GPU" in
*H200*)
  wait
  tail -1 $O/synth.log | tee -a $S
  T=$((530 - SECONDS)); [ $T -lt 30 ] && T=30
  timeout $T $G/main/lily bench --model $CK --out $O/contract-main.json --markdown $O/contract-main.md > $O/contract-main.txt 2>&1; echo "lily bench rc $? at ${SECONDS}s" | tee -a $S
  cat $O/contract-main.md 2>/dev/null | tee -a $S
  (cd $OUT && tar czf r19.tgz r19)
  timeout 50 $G/main/qmm_probe 1,8,64 0,2,11,12,13,14 > $O/qmm-probe-parts.txt 2>&1; grep -E "in_proj  |moe:" $O/qmm-probe-parts.txt | tee -a $S ;;
*)
  timeout 100 $G/main/qmm_probe 64 0,2,6 > $O/qmm-probe-rings.txt 2>&1; grep -E "device copy|moe:" $O/qmm-probe-rings.txt | tee -a $S ;;
esac
(cd $OUT && tar czf r19.tgz r19)
