# Session 51, call 5. c15.tar.xz: main/{bench,lily} = main ff98d920. c16.tar.xz: whole/qmm_probe (main's
# sliced expert kernels beside the whole-K ones). c18.tar.xz: r3/{bench,lily,gpu_qmm,qmm_probe} = branch
# s51-ring3 (the expert kernel on rings of 3 from 9 tokens).
#  1. bench steps at 1, 9, 16, 32, 64: main, r3, main, r3; 2. the probes alone at 16 / 64; 3. gpu_qmm's MoE
#  tests of r3; 4. H200 only: 64 clients, main and r3 (then 5, below).
#   run(command="bash docs/perf/2026-12-05-s51/devrun-5.sh", carry=["c15.tar.xz", "c16.tar.xz", "c18.tar.xz"], kind="nvidia-h200")
set -u
R=$PWD; for c in 15 16 18; do rm -rf /tmp/b$c; mkdir -p /tmp/b$c && tar xJf $R/c$c.tar.xz -C /tmp/b$c; done
O=$OUT/r5; mkdir -p $O; M=/tmp/lily-full; S=$OUT/summary.txt; export RUST_BACKTRACE=1
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU" | tee -a $S
H200=0; case "$GPU" in *H200*) H200=1;; esac
SYN=; if [ $H200 = 1 ] && [ ! -f $M/config.json ]; then (RAYON_NUM_THREADS=8 nice -n 19 /tmp/b15/main/lily synth --preset full --out $M > $O/synth.log 2>&1) & SYN=$!; fi
run_bench() { timeout 80 $2 --random-layers 40 --lengths "" --batch 1,9,16,32,64 > $O/bench-$1.json 2>> $O/bench-err.txt || echo "bench $1 failed" | tee -a $S
  python3 -c "
import json,sys
rows=[json.loads(l) for l in open(sys.argv[1]) if l.startswith('{')]
b=[r for r in rows if 'batch' in r]
print(sys.argv[2], ' '.join('b%d %.3f %s' % (r['batch'], r['step_ms'], r['seq0_digest'][:6]) for r in b))" $O/bench-$1.json $1 | tee -a $S; }
run_bench main-1 /tmp/b15/main/bench; run_bench r3-1 /tmp/b18/r3/bench
run_bench main-2 /tmp/b15/main/bench; run_bench r3-2 /tmp/b18/r3/bench
timeout 40 /tmp/b16/whole/qmm_probe 16,64 0 > $O/probe-main.txt 2>&1; grep -a 'moe:' $O/probe-main.txt | sed 's/^/main /' | tee -a $S
timeout 40 /tmp/b18/r3/qmm_probe 16,64 0 > $O/probe-r3.txt 2>&1; grep -a 'moe:' $O/probe-r3.txt | sed 's/^/r3 /' | tee -a $S
LILY_REQUIRE_GPU=1 timeout 90 /tmp/b18/r3/gpu_qmm moe_ --test-threads=2 --nocapture > $O/gpu_qmm.log 2>&1; echo "gpu_qmm moe_ rc $?: $(grep -a 'test result' $O/gpu_qmm.log)" | tee -a $S
grep -a 'FAIL\|panicked' $O/gpu_qmm.log | head -8 | tee -a $S
(cd $OUT && tar czf r5.tgz r5)
echo "after A/B: ${SECONDS}s" | tee -a $S
[ $H200 = 1 ] || exit 0
[ -n "$SYN" ] && { wait $SYN; tail -1 $O/synth.log | tee -a $S; }
J() { python3 -c "
import json,sys; j=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], ' | '.join('%d: %.1f tok/s ttft %.1f itl %.3f err %d' % (p['clients'], p['agg_output_tok_s'], 1000*p['ttft_s']['p50'], 1000*p['itl_s']['p50'], p['errors']) for p in j['phases']))" "$1" | tee -a $S; }
for v in main r3; do
  if [ $v = main ]; then L=/tmp/b15/main/lily; else L=/tmp/b18/r3/lily; fi
  LILY_BIN=$L BENCH_JSON=$O/serve64-$v.json timeout 60 bash scripts/bench-serve.sh $M 64 2 128 > $O/serve64-$v.txt 2>&1 || echo "serve64 $v failed" | tee -a $S; J $O/serve64-$v.json
done
(cd $OUT && tar czf r5.tgz r5)
# 5. H200 only: the contract as the issues define it (`lily bench`, all ten lengths, median of 2 rounds) and
#    the backend's batch sweep, on main's lily.
timeout $((560 - SECONDS)) /tmp/b15/main/lily bench --model $M --out $O/contract-main.json --markdown $O/contract-main.md > $O/contract-main.txt 2>&1; echo "lily bench rc $?" | tee -a $S
cat $O/contract-main.md 2>/dev/null | tee -a $S
(cd $OUT && tar czf r5.tgz r5)
[ $SECONDS -lt 540 ] && { timeout $((585 - SECONDS)) /tmp/b15/main/lily bench --model $M --batch 1,2,4,8,16,32,64,128 --out $O/batch-main.json > $O/batch-main.txt 2>&1; echo "lily bench --batch rc $?" | tee -a $S; tail -12 $O/batch-main.txt | tee -a $S; }
(cd $OUT && tar czf r5.tgz r5)
