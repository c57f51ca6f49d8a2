# Session 60, call 7 (any card, ~4 min): 1, 8 and 64 clients served (scripts/bench-serve.sh, 2 requests of 128
# tokens, one round each) by main before and after history 206 (c59h.tar.xz: b7a77f2a; c60h.tar.xz: 11a808b5),
# through crates/cuda/scripts/ab-revisions.sh (no tests, no bench rounds).
set -u
R=$PWD; S=$OUT/summary.txt; mkdir -p /tmp/x/g60e
nvidia-smi --query-gpu=name --format=csv,noheader | tee $S
tar xJf $R/c59h.tar.xz -C /tmp/x && tar xJf $R/c60h.tar.xz -C /tmp/x || { echo "tarball missing" | tee -a $S; exit 1; }
mv /tmp/x/g59h/main /tmp/x/g60e/b7a77f2a; mv /tmp/x/g60h/main /tmp/x/g60e/11a808b5; cp /tmp/x/g60h/ab-revisions.sh /tmp/x/g60e/
RAYON_NUM_THREADS=16 /tmp/x/g60e/11a808b5/lily synth --preset full --out /tmp/lily-full > /tmp/synth.log 2>&1; echo "synth rc $? at ${SECONDS}s" | tee -a $S
RUN_TESTS=0 ROUNDS=0 SERVE_CLIENTS="1,8,64" SERVE_ROUNDS=1 timeout 480 bash /tmp/x/g60e/ab-revisions.sh run /tmp/x/g60e $OUT/r7 2>&1 | tail -20 | tee -a $S
for f in $OUT/r7/*-serve1.json; do python3 -c "
import json,sys; j=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], ' | '.join('%d: %.1f tok/s ttft p50 %.1f ms err %d' % (p['clients'], p['agg_output_tok_s'], 1000*p['ttft_s']['p50'], p['errors']) for p in j['phases']))" $f | tee -a $S; done
(cd $OUT && tar czf r7.tgz r7 && rm -rf r7)
