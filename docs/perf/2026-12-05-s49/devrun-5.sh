# Session 49's timeline call (c8.tar.xz: main/bench = 41dfade1, m2d/bench = moe-m2 a5cb031d: the down projections
# on 32-row tasks from 2 tokens, plus kernel_trace): bench --timeline (CUPTI kernel records of 5 traced steps a
# batch size) on main at 1, 8, 64 and on m2d at 8, 32; libcupti from the toolkit, found here.
#   run(command="bash docs/perf/2026-12-05-s49/devrun-5.sh", carry=["c8.tar.xz"])
set -u
R=$PWD; rm -rf /tmp/b9; mkdir -p /tmp/b9 && tar xJf $R/c8.tar.xz -C /tmp/b9; B=/tmp/b9; O=$OUT/tl; mkdir -p $O
S=$OUT/summary.txt; export RUST_BACKTRACE=1
nvidia-smi --query-gpu=name,clocks.max.sm,driver_version --format=csv,noheader | tee -a $S
L=$(find /usr/local /usr/lib /opt -name 'libcupti.so*' 2>/dev/null | grep -v 'cu12\|/12\.' | head -3); echo "cupti: $L" | tee -a $S
export LD_LIBRARY_PATH=$(for f in $L; do dirname $f; done | sort -u | tr '\n' ':')${LD_LIBRARY_PATH:-}
timeout 150 $B/main/bench --random-layers 40 --lengths 256 --batch 1,8,64 --timeline > $O/main.jsonl 2> $O/main.err; echo "main rc $?" | tee -a $S
tail -3 $O/main.err | tee -a $S
grep -a -A14 'timeline of' $O/main.err | head -60 >> $S
(cd $OUT && tar czf tl-main.tgz tl)
timeout 120 $B/m2d/bench --random-layers 40 --lengths 256 --batch 8,32 --timeline > $O/m2d.jsonl 2> $O/m2d.err; echo "m2d rc $?" | tee -a $S
grep -a -A14 'timeline of' $O/m2d.err | head -40 >> $S
cd $OUT && tar czf tl.tgz tl && rm -rf tl
