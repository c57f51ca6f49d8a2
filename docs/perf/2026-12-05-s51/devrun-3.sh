# Session 51, call 3 (the warm H200 of call 2): main's second contract round, one client, and main's timelines.
#   run(command="bash docs/perf/2026-12-05-s51/devrun-3.sh", carry=["c15.tar.xz"], kind="nvidia-h200")
set -u
R=$PWD; [ -x /tmp/b15/main/bench ] || { rm -rf /tmp/b15; mkdir -p /tmp/b15 && tar xJf $R/c15.tar.xz -C /tmp/b15; }
O=$OUT/r3; mkdir -p $O; M=/tmp/lily-full; S=$OUT/summary.txt
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $S
J() { python3 -c "
import json,sys; j=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], ' | '.join('%d: %.1f tok/s ttft %.1f itl %.3f err %d' % (p['clients'], p['agg_output_tok_s'], 1000*p['ttft_s']['p50'], 1000*p['itl_s']['p50'], p['errors']) for p in j['phases']))" "$1" | tee -a $S; }
timeout 150 /tmp/b15/main/bench --random-layers 40 --lengths 256,4096,32768,131072 > $O/contract.jsonl 2> $O/contract.err; echo "contract rc $?" | tee -a $S; grep -a '^{' $O/contract.jsonl | cut -c1-120 | tee -a $S
[ -f $M/config.json ] && { LILY_BIN=/tmp/b15/main/lily BENCH_JSON=$O/serve1.json timeout 60 bash scripts/bench-serve.sh $M 1 4 128 > $O/serve1.txt 2>&1 || echo "serve1 failed" | tee -a $S; J $O/serve1.json; }
L=$(find /usr/local -name 'libcupti.so*' 2>/dev/null | grep -v 'cu12\|/12\.' | head -3); TLP=$(for f in $L; do dirname $f; done | sort -u | tr '\n' ':')
LD_LIBRARY_PATH=$TLP${LD_LIBRARY_PATH:-} timeout 120 /tmp/b15/main/bench --random-layers 40 --lengths 256,4096 --batch 1,8,64 --timeline > $O/timeline.jsonl 2> $O/timeline.err; echo "timeline rc $?" | tee -a $S
grep -a -A12 'timeline of\|prefill of' $O/timeline.err | cut -c1-90 >> $S
(cd $OUT && tar czf r3.tgz r3)
