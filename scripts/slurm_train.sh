#!/usr/bin/env bash
# Multi-node GRPO training under SLURM: N nodes x 8 GPUs, one `accelerate launch` per node (srun
# starts one task per node; each launch starts one process per GPU of its node).
#
#   sbatch --nodes 4 scripts/slurm_train.sh configs/flux_pickscore.yaml [section.key=value ...]
#   ACCELERATE_CONFIG=configs/accelerate/fsdp_multinode.yaml sbatch --nodes 2 scripts/slurm_train.sh CONFIG
#
# Environment (all optional):
#   ACCELERATE_CONFIG  accelerate config file (default configs/accelerate/ddp_multinode.yaml); its
#                      num_machines, num_processes, machine_rank and main_process_ip/port are
#                      replaced by the values of this allocation
#   GPUS_PER_NODE      processes per node (default 8; keep it equal to --gpus-per-node)
#   MASTER_PORT        rendezvous port on the first node (default derived from the job id)
#   RESUME             --resume value (default: latest in a requeued job, so that a requeue without
#                      a checkpoint fails loudly instead of starting over; auto in a first job,
#                      which continues the run's newest checkpoint or starts the run)
#
# Preemption and the time limit: Slurm sends USR1 to this script SIGNAL_LEAD seconds (300 by
# default: `#SBATCH --signal` below) before the limit. The script passes it to every training
# process (the launchers ignore it), each saves a checkpoint at its next safe point and exits with
# 138 (docs/reliability.md, "Signals"), and the script requeues the job, which resumes from that
# checkpoint. Keep the lead above one iteration plus one checkpoint save. A checkpoint save that
# outlives the lead is killed with the job; the previous checkpoint stays complete.
# Submit from the repository root with the training environment active: sbatch passes the
# submitting shell's environment (PATH included) to the job.
#
#SBATCH --job-name=flowgrpo
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --output=slurm-%x-%j.out
#SBATCH --open-mode=append
#SBATCH --requeue
#SBATCH --signal=B:USR1@300
set -euo pipefail

if [[ -z "${SLURM_JOB_NODELIST:-}" ]]; then
  echo "slurm_train.sh: SLURM_JOB_NODELIST is unset: submit this script with sbatch (or run it" \
       "inside an salloc allocation)" >&2
  exit 2
fi
if [[ $# -lt 1 ]]; then
  echo "usage: sbatch [--nodes N] scripts/slurm_train.sh CONFIG [section.key=value ...]" >&2
  exit 2
fi
CONFIG=$1
shift
cd "${SLURM_SUBMIT_DIR:-.}"
if [[ ! -f "$CONFIG" ]]; then
  echo "slurm_train.sh: config file $CONFIG does not exist (paths are relative to $PWD)" >&2
  exit 2
fi
ACCELERATE_CONFIG=${ACCELERATE_CONFIG:-configs/accelerate/ddp_multinode.yaml}
if [[ ! -f "$ACCELERATE_CONFIG" ]]; then
  echo "slurm_train.sh: ACCELERATE_CONFIG=$ACCELERATE_CONFIG does not exist; pick one of" \
       "configs/accelerate/*multinode.yaml" >&2
  exit 2
fi
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
# The first host of the allocation runs rank 0 and the rendezvous.
# awk reads every line (head would exit first and, under pipefail, fail the job with SIGPIPE)
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | awk 'NR == 1')
# A port derived from the job id: two jobs that share a node (without --exclusive) would
# otherwise both bind the same fixed port.
MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
NUM_NODES=${SLURM_NNODES:-${SLURM_JOB_NUM_NODES:?SLURM_NNODES is unset}}
if [[ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]]; then
  RESUME=${RESUME:-latest}
else
  RESUME=${RESUME:-auto}
fi
export ACCELERATE_CONFIG GPUS_PER_NODE MASTER_ADDR MASTER_PORT NUM_NODES RESUME
echo "slurm_train.sh: $NUM_NODES nodes x $GPUS_PER_NODE GPUs, rank 0 on $MASTER_ADDR:$MASTER_PORT," \
     "accelerate config $ACCELERATE_CONFIG, run config $CONFIG $*, --resume $RESUME"

# USR1 (from #SBATCH --signal, or `scancel --batch --signal=USR1 JOBID` by hand): pass it to the
# job step's processes (Slurm signals every process of the step); the launchers ignore it (the
# trap '' below, inherited through exec), the training processes save and exit. Then requeue.
preempted=0
forward_stop() {
  [[ "$preempted" -eq 1 ]] && return   # once: a repeated USR1 changes nothing
  preempted=1
  echo "slurm_train.sh: USR1 received: the training processes save a checkpoint and stop; the" \
       "job is requeued after they exit" >&2
  scancel --signal=USR1 "$SLURM_JOB_ID" || true
}
trap forward_stop USR1

# The launch line is in single quotes so that SLURM_NODEID expands inside each srun task, where
# it is that node's index (in this batch script it would be 0 on every node). srun runs in the
# background: bash runs a trap only between commands, and `wait` returns when one arrives.
# shellcheck disable=SC2016
srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c '
  trap "" USR1
  exec accelerate launch \
    --config_file "$ACCELERATE_CONFIG" \
    --num_machines "$NUM_NODES" \
    --num_processes "$((NUM_NODES * GPUS_PER_NODE))" \
    --machine_rank "$SLURM_NODEID" \
    --main_process_ip "$MASTER_ADDR" \
    --main_process_port "$MASTER_PORT" \
    -m flowgrpo train --resume "$RESUME" "$@"' slurm_train "$CONFIG" "$@" &
srun_pid=$!
status=0
while true; do
  wait "$srun_pid" && status=0 || status=$?
  # a status above 128 with srun still running is the trap interrupting `wait`: wait again
  if ! kill -0 "$srun_pid" 2>/dev/null; then
    break
  fi
done
if [[ "$preempted" -eq 1 ]]; then
  echo "slurm_train.sh: training stopped on USR1 (exit $status); requeueing job $SLURM_JOB_ID" >&2
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
exit "$status"
