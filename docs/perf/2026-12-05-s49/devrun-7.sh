# Session 49's last call (c9.tar.xz: comb/{bench,gpu_attention} = combine-rows 93d18402: attn_combine_rows for
# steps of 5+ tokens, bit-identical to attn_combine by construction). With a few seconds of device time left:
#  1. gpu_attention's decode tests with LILY_REQUIRE_GPU=1 (the batch of 5 on the rows kernel bit for bit
#     against each token alone on attn_combine; 64 and 128 tokens against the reference);
#  2. bench --timeline at 64 sequences (the combine's share of the step; main's was 21.7 us a layer, call 4).
#   run(command="bash docs/perf/2026-12-05-s49/devrun-7.sh", carry=["c9.tar.xz"])
set -u
R=$PWD; rm -rf /tmp/b11; mkdir -p /tmp/b11 && tar xJf $R/c9.tar.xz -C /tmp/b11; B=/tmp/b11/comb; S=$OUT/summary.txt
LILY_REQUIRE_GPU=1 timeout 120 $B/gpu_attention decode_attention --test-threads=2 > $OUT/gpu_attention.log 2>&1; echo "gpu_attention rc $?: $(grep -a 'test result' $OUT/gpu_attention.log)" >> $S
L=$(find /usr/local -name 'libcupti.so*' 2>/dev/null | grep -v 'cu12\|/12\.' | head -3)
LD_LIBRARY_PATH=$(for f in $L; do dirname $f; done | sort -u | tr '\n' ':')${LD_LIBRARY_PATH:-} timeout 60 $B/bench --random-layers 40 --lengths "" --batch 64 --timeline > $OUT/comb-tl.jsonl 2> $OUT/comb-tl.err; echo "timeline rc $?" >> $S
grep -a -A16 'timeline of' $OUT/comb-tl.err >> $S; grep -a '"batch"' $OUT/comb-tl.jsonl >> $S
