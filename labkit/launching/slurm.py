"""Writing a SLURM batch script for a cluster: srun starts one torchrun agent per node (`labkit slurm`).

The first node of the allocation hosts torchrun's (static) rendezvous and global rank 0; every node runs
`python -m labkit run|launch ... --nnodes N --node-rank $SLURM_NODEID --rdzv-endpoint HEAD:PORT`,
so the cluster job gets the same run directories, logs and checks as a laptop run.
"""

from __future__ import annotations

import shlex

from ..core.errors import ConfigError


def slurm_script(kit_args: list[str], nodes: int, gpus_per_node: int = 0, job_name: str = "pplab",
                 time_limit: str = "00:30:00", partition: str | None = None, port: int = 29400,
                 python: str = "python", runs_root: str = "runs") -> str:
    """The text of an sbatch script that runs `labkit <kit_args>` on `nodes` nodes (one task per node)."""
    if nodes < 1:
        raise ConfigError(f"--nodes must be at least 1, got {nodes}.")
    if gpus_per_node < 0:
        raise ConfigError(f"--gpus-per-node must be 0 or more, got {gpus_per_node}.")
    if not kit_args or kit_args[0] not in ("run", "launch"):
        raise ConfigError("Give the labkit command to run on every node after --, e.g. "
                          "labkit slurm --nodes 2 -- run --schedule 1F1B --nproc 4")
    if any(a in kit_args for a in ("--nnodes", "--node-rank", "--rdzv-endpoint", "--out")):
        raise ConfigError("Leave out --nnodes, --node-rank, --rdzv-endpoint and --out: "
                          "the batch script sets them per node.")
    lines = ["#!/bin/bash", f"#SBATCH --job-name={job_name}", f"#SBATCH --nodes={nodes}",
             "#SBATCH --ntasks-per-node=1", f"#SBATCH --time={time_limit}"]
    if gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={gpus_per_node}")
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    cmd = " ".join(shlex.quote(a) for a in kit_args)
    lines += [
        "set -euo pipefail",
        "# The first node hosts the rendezvous; every node joins it.",
        # sed reads the whole list: `head -n 1` would close the pipe early, and under pipefail the
        # SIGPIPE that scontrol gets then ends the script (exit 141).
        'HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)',
        f"PORT={port}",
        f"RUNS={shlex.quote(runs_root)}/slurm-$SLURM_JOB_ID",
        'mkdir -p "$RUNS"',
        "export HEAD PORT RUNS",
        f"srun --nodes={nodes} --ntasks-per-node=1 bash -c '"
        f"exec {python} -m labkit {cmd} --nnodes {nodes} --node-rank $SLURM_NODEID "
        f"--rdzv-endpoint $HEAD:$PORT --rdzv-id pplab-$SLURM_JOB_ID --out $RUNS/node$SLURM_NODEID'",
        "",
    ]
    return "\n".join(lines)
