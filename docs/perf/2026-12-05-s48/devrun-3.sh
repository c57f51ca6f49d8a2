# Session 48's third call: x-prefetch (xp: qmm requests the next stage's first x fragments during the stage
# before it, inside a task) and x-prefetch-task (xp2: also the next task's, during a task's last stage)
# against main: bench --random-layers 40 --lengths 256 --batch 1,8,64 of main, xp and xp2 in two
# interleaved rounds (equal digests = the same greedy tokens), then xp2's gpu_qmm and gpu_model
# (LILY_REQUIRE_GPU=1, side by side), then Nsight Compute of qmm_moe_1 at batch 64 (the stalls
# devrun-2.sh measured on main). On an H200 also main's serving (1 client, 4 requests; 8 and 64 clients,
# 2 requests each: the fp16 dense inputs now on by default). c3.tar.xz: xp/bench, xp2/{bench,gpu_qmm,
# gpu_model}, main/{bench,lily}.
#   run(command="bash docs/perf/2026-12-05-s48/devrun-3.sh", carry=["c3.tar.xz"])
set -u
R=$PWD; rm -rf /tmp/b3; mkdir -p /tmp/b3 && tar xJf $R/c3.tar.xz -C /tmp/b3; O=/tmp/r3; rm -rf $O; mkdir -p $O; B=/tmp/b3; M=/tmp/lily-full
# summary.txt lives in $OUT itself, so a call cut at its limit still returns it.
ln -sf $OUT/summary.txt $O/summary.txt
export RUST_BACKTRACE=1
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | tee $O/gpu.txt); echo "$GPU"
H200=0; case "$GPU" in *H200*) H200=1;; esac
SYN=; if [ $H200 = 1 ] && [ ! -f $M/config.json ]; then (RAYON_NUM_THREADS=10 nice -n 19 $B/main/lily synth --preset full --out $M > $O/synth.log 2>&1) & SYN=$!; fi
for r in 1 2; do for v in main xp xp2; do
  timeout 60 $B/$v/bench --random-layers 40 --lengths 256 --batch 1,8,64 > $O/bench-$v-$r.json 2>> $O/err.txt || echo "bench $v $r failed" | tee -a $O/summary.txt
  grep -h '^{' $O/bench-$v-$r.json | cut -c1-130 | sed "s/^/$v $r /" | tee -a $O/summary.txt
done; done
P=; for s in gpu_qmm gpu_model; do (LILY_REQUIRE_GPU=1 timeout 200 $B/xp2/$s --test-threads=2 --nocapture > $O/$s.log 2>&1; echo "xp2 $s rc $?: $(grep -a 'test result' $O/$s.log)" >> $O/summary.txt) & P="$P $!"; done
wait $P
cat $O/summary.txt; grep -a 'FAILED\|panicked' $O/gpu_qmm.log $O/gpu_model.log | head
N="dram__bytes_read.sum,gpu__time_duration.sum,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__issue_active.avg.pct_of_peak_sustained_elapsed,l1tex__t_sector_pipe_lsu_mem_global_op_ld_hit_rate.pct"
for v in xp2 main; do timeout 50 ncu --clock-control none -k regex:'qmm_moe_1$' --launch-skip 16 -c 2 --metrics $N $B/$v/bench --random-layers 4 --lengths "" --batch 64 > $O/ncu-$v-b64.txt 2>&1 || echo "ncu $v rc $?"
  echo "== ncu $v batch 64" | tee -a $O/summary.txt; grep -E 'duration|bytes_read|stalled|issue_active|hit_rate' $O/ncu-$v-b64.txt | awk '{print $1, $NF}' | tee -a $O/summary.txt; done
if [ $H200 = 1 ]; then
  [ -n "$SYN" ] && { wait $SYN; tail -1 $O/synth.log; }
  S() { python3 -c "
import json,sys; j=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], ' | '.join('%d: %.1f tok/s ttft %.1f itl %.3f err %d' % (p['clients'], p['agg_output_tok_s'], 1000*p['ttft_s']['p50'], 1000*p['itl_s']['p50'], p['errors']) for p in j['phases']))" "$1" | tee -a $O/summary.txt; }
  LILY_BIN=$B/main/lily BENCH_JSON=$O/serve1.json timeout 50 bash scripts/bench-serve.sh $M 1 4 128 > $O/serve1.txt 2>&1 || echo "serve1 failed" | tee -a $O/summary.txt; S $O/serve1.json
  LILY_BIN=$B/main/lily BENCH_JSON=$O/serve8-64.json timeout 70 bash scripts/bench-serve.sh $M 8,64 2 128 > $O/serve8-64.txt 2>&1 || echo "serve failed" | tee -a $O/summary.txt; S $O/serve8-64.json
fi
rm -f $O/summary.txt; cd /tmp && tar czf $OUT/r3.tgz r3
