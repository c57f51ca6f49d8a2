# Session 60, call 9 (any card, ~1.5 min), c60h.tar.xz (main 11a808b5): what a served step adds to the greedy
# graph loop's step at 1 and 64 sequences (bench --served --split: the step's parts by events), for issue 10's
# one-client line (served / contract decode).
set -u
R=$PWD; S=$OUT/summary.txt; O=$OUT/r8; mkdir -p $O /tmp/g
nvidia-smi --query-gpu=name --format=csv,noheader | tee $S
[ -d /tmp/g/g60h ] || tar xJf $R/c60h.tar.xz -C /tmp/g || { echo "tarball missing" | tee -a $S; exit 1; }
B=/tmp/g/g60h/main/bench; echo "main $(cut -c1-8 /tmp/g/g60h/main/REVISION)" | tee -a $S
timeout 200 $B --random-layers 40 --lengths "" --batch 1,64 --served --split > $O/served.jsonl 2> $O/served.err; echo "served rc $? at ${SECONDS}s" | tee -a $S
cat $O/served.jsonl | cut -c1-400 | tee -a $S
tail -30 $O/served.err | tee -a $S
(cd $OUT && tar czf r8.tgz r8 && rm -rf r8)
