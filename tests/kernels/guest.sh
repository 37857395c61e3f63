#!/usr/bin/env bash
# Runs inside a kernel VM (tests/kernels/vm.sh), started by tests/kernels/matrix.sh: the
# BPF_PROG_TEST_RUN fixtures, then collectives on virtual clusters at each MTU. Binaries
# were built on the host; their paths are in the manifest matrix.sh wrote. Every step
# prints one `step: NAME ok|FAIL (N s)` line that matrix.sh collects; the exit status is
# the number of failed steps (capped at 80, below vm.sh's own 90/91).
#
#   tests/kernels/guest.sh smoke|full MANIFEST "MTU..."
set -uo pipefail
mode=$1 manifest=$2 mtus=$3
export KCCL_REQUIRE_ROOT=1   # a skipped BPF test inside the VM is a failure, not a pass
failed=0

bin() { awk -v n="$1" '$1 == n {print $2}' "$manifest"; }

step() {   # step NAME COMMAND...: run, time, report
  local name=$1; shift
  local t0=$SECONDS rc
  echo "--- step: $name: $*"
  "$@" 2>&1 | tail -n 40
  rc=${PIPESTATUS[0]}
  if [ "$rc" -eq 0 ]; then
    echo "step: $name ok ($((SECONDS - t0)) s)"
  else
    echo "step: $name FAIL exit $rc ($((SECONDS - t0)) s)"
    failed=$((failed + 1))
  fi
}

# What runs in the full matrix: kernel-path topologies that cover broadcast, reduce,
# allreduce, bad input and loss, small enough for an emulated CPU.
full_topologies=(
  "topology_broadcast a_kernel_path_9_receivers"
  "topology_broadcast b_kernel_path_subset_of_destinations"
  "topology_aggregation a_kernel_path_4_senders"
  "topology_aggregation a_kernel_aggregator_only_2_senders"
  "topology_aggregation c_kernel_path_bad_input"
  "topology_agg_faults reduce_exact_under_faults_kernel"
  "topology_agg_faults allreduce_exact_under_faults_kernel"
  "topology_agg_faults sharded_exact_under_faults_kernel"
  "topology_agg_faults sharded_dead_member_kernel"
  "topology_aggregation e_kernel_path_sharded_4_members"
  "topology_broadcast_faults a_loss_on_sender_link"
  "agg_kernel_smoke agg_kernel_smoke"
  "topology_cold_neighbours kernel_allreduce_and_reduce_with_cold_neighbour_tables"
  "topology_scatter_gather b_kernel_path_dead_worker_long_replies_and_concat"
  "topology_scatter_gather c_kernel_path_under_loss_and_duplication"
)

for fixtures in bpf_agg_fixtures bpf_bcast_fixtures bpf_fault_fixtures bpf_sg_fixtures; do
  step "$fixtures" "$(bin "$fixtures")" --test-threads=1
done

kccl=$(bin kccl_cli)
for mtu in $mtus; do
  # One small broadcast, reduce and allreduce on both paths, each checked for exactness.
  step "demo-mtu$mtu" "$kccl" demo --hosts 4 --iters 20 --agg-iters 1 --mtu "$mtu"
  if [ "$mode" = full ]; then
    for t in "${full_topologies[@]}"; do
      set -- $t
      step "$1::$2-mtu$mtu" env KCCL_CLUSTER_MTU="$mtu" "$(bin "$1")" --exact "$2" --test-threads=1
    done
  fi
done

echo "guest: $failed failed step(s) on $(uname -r)"
exit $((failed > 80 ? 80 : failed))
