# Session 45, call 4 (bins48.tar.xz: route-fused 7fd4e0b0's, main c84e54db's and served-graph 0001a7fd's bench).
# 1. Nsight Compute (no clock control) of one decode step's out-projection and router kernels, 4 random
#    full-shape layers: route-fused with --fused-route off (qmm_dense_{1,2}_wide + moe_router) and on
#    (qmm_dense_{1,2}_wide_route), batch 1; on at batch 8.
# 2. bench --served --split (the served step by parts) on main and served-graph, batch 1 and 8, two rounds.
set -u
R=$PWD; mkdir -p /tmp/b && cd /tmp/b && tar xJf $R/bins48.tar.xz && cd $R; O=$OUT/c4; mkdir -p $O
B=/tmp/b
for v in "1 off" "1 on" "8 on" "8 off"; do set -- $v
  timeout 100 ncu --clock-control none -k regex:'qmm_dense_[12]_wide|moe_router' --launch-skip 24 -c 12 \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum \
    $B/route-fused/bench --random-layers 4 --lengths "" --batch $1 --fused-route $2 > $O/ncu-b$1-$2.txt 2>&1 || echo "ncu b$1 $2 rc $?"
  echo "== batch $1 fused $2"; grep -E '^  [a-z_0-9]+ \(|gpu__time_duration' $O/ncu-b$1-$2.txt | paste - - | awk '{print $1, $(NF)}' | sort | uniq -c
done
for r in 1 2; do for v in main served-graph; do timeout 60 $B/$v/bench --random-layers 40 --lengths "" --batch 1,8 --served --split > $O/split-$v-$r.json 2>> $O/err.txt || echo "split $v $r failed"; done; done
for f in $O/split-*.json; do echo "== $(basename $f)"; grep -h '^{' $f | cut -c1-260; done
