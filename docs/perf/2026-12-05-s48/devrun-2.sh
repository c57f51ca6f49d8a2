# Session 48's second call: is the batch-64 expert kernel (qmm_moe_1, 85.8 us a launch, 2.29 TB/s of DRAM in
# session 40) bound by the packed activations it re-reads from L2? Each warp of a task reads its tokens' x for
# every group (ldg128, one group ahead) and consecutive blocks take consecutive tasks of one item, so no two
# blocks of an SM share an item's x. Nsight Compute (no clock control) of qmm_moe_1 at batch 64 and 8
# (4 random full-shape layers, main's bench): speed of light, memory workload, warp states, and L1 / L2
# sectors by source. c1.tar.xz: f16/bench (the MoE is main's).
#   run(command="bash docs/perf/2026-12-05-s48/devrun-2.sh", carry=["c1.tar.xz"])
set -u
R=$PWD; [ -x /tmp/b/f16/bench ] || { mkdir -p /tmp/b && tar xJf $R/c1.tar.xz -C /tmp/b; }; O=$OUT/r2; mkdir -p $O; B=/tmp/b/f16
M="l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,l1tex__t_sector_pipe_lsu_mem_global_op_ld_hit_rate.pct,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum,dram__bytes_read.sum,gpu__time_duration.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__throughput.avg.pct_of_peak_sustained_elapsed,smsp__average_warp_latency_issue_stalled_long_scoreboard.ratio,smsp__average_warp_latency_issue_stalled_short_scoreboard.ratio,smsp__average_warp_latency_issue_stalled_barrier.ratio,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio,smsp__issue_active.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active"
for b in 64 8; do
  timeout 150 ncu --clock-control none -k regex:'qmm_moe_1$' --launch-skip 16 -c 4 --section SpeedOfLight --section WarpStateStats --metrics $M \
    $B/bench --random-layers 4 --lengths "" --batch $b > $O/ncu-moe-b$b.txt 2>&1 || echo "ncu b$b rc $?"
  echo "== batch $b"; grep -E 'qmm_moe_1|sectors|hit|bytes_read|duration|throughput|stalled|issue_active|warps_active|Stall' $O/ncu-moe-b$b.txt | head -60
done
cd $OUT && tar czf r2.tgz r2 && rm -rf r2
