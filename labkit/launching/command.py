"""What a launch runs: the torchrun argv (never a shell string), the ranks' environment, and the
checks made before anything starts (nodes, one GPU per rank).

Single-node jobs rendezvous on 127.0.0.1 on an OS-chosen port (`labkit.launching.rendezvous`); multi-node
jobs use torchrun's static rendezvous, so `--node-rank` decides global ranks. The kit's own jobs
run as modules of the installed package (`-m labkit.jobs.train`): nothing reads the repository's
folders. PYTHONPATH gets one folder first, the kit's `labkit/spans/boot` (a sitecustomize that
records spans when torch's pipelining is imported, and imports torch with Python's cyclic collector
paused: `labkit.core.startup`). Taught in notebook 00.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from ..core.processes import OWNER_VAR, RUN_DIR_VAR, owner_token
from ..core.errors import ConfigError
from ..logs.parse import PP_LOG_FORMAT  # the kit's log format (its home is beside its reader)
from .rendezvous import BACKEND_NAME
from ..spans.paths import BOOT_DIR, SPANS_DIR_VAR

DEFAULT_TIMEOUT_S = float(os.environ.get("LABKIT_TIMEOUT", "900"))  # a hung lab job ends within 15 minutes


def torchrun_command(entry: str | os.PathLike, script_args: list[str], nproc: int, run_dir: Path,
                     nnodes: int = 1, node_rank: int = 0, rdzv_endpoint: str | None = None,
                     rdzv_id: str | None = None, module: bool = False) -> list[str]:
    """argv for torchrun: `entry` is a script path, or a module name with `module=True`."""
    cmd = [sys.executable, "-m", "torch.distributed.run"]
    if nnodes == 1 and rdzv_endpoint is None:
        if os.environ.get("LABKIT_RDZV") == "standalone":  # escape hatch: torchrun's own (all interfaces)
            cmd += ["--standalone", "--nnodes", "1"]
        else:  # loopback-only stores on an OS-chosen port (labkit.launching.rendezvous)
            cmd += ["--nnodes", "1", "--rdzv-backend", BACKEND_NAME, "--rdzv-endpoint", "127.0.0.1:0",
                    "--rdzv-id", f"labkit-{run_dir.name}", "--local-addr", "127.0.0.1"]
    else:
        if not rdzv_endpoint:
            raise ConfigError("A multi-node job needs a rendezvous endpoint HOST:PORT reachable from every node.")
        # static, not c10d: c10d ignores --node-rank and numbers nodes by the order it sorts them in, so
        # global rank 0 (and its result.json) could land on any node. Static honours --node-rank: node 0
        # hosts the store at the endpoint and holds ranks 0..nproc-1.
        cmd += ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--rdzv-backend", "static",
                "--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", rdzv_id or f"labkit-{rdzv_endpoint}"]
    cmd += ["--nproc-per-node", str(nproc), "--max-restarts", "0",
            "--log-dir", str(run_dir / "logs"), "--redirects", "3"]
    cmd += ["-m", str(entry)] if module else [str(entry)]
    return cmd + list(script_args)


def job_env(run_dir: Path, extra: dict | None = None, pp_logs: bool = True, single_node: bool = True,
            nproc: int | None = None) -> dict:
    """The ranks' environment: the launching process's, kept (a user's own variables are never replaced),
    with what the kit needs added: loopback gloo, unbuffered output and stack dumps (each only where the
    user set no value of their own), the kit's markers, the spans' boot folder first on PYTHONPATH, and
    the PP logs merged into the user's own TORCH_LOGS (`merge_torch_logs`). `kit_changes` says, variable
    by variable, what differs from the launching process (command.txt carries it)."""
    env = dict(os.environ)
    if single_node and sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's listeners on loopback only
    env.setdefault("PYTHONUNBUFFERED", "1")  # rank output reaches the files (and the cell) line by line
    env.setdefault("PYTHONFAULTHANDLER", "1")  # SIGABRT dumps every thread's stack into the rank's stderr.log
    env[RUN_DIR_VAR] = str(run_dir.resolve())  # marks the kit's processes (labkit clean) and tells jobs where to write
    env[OWNER_VAR] = owner_token()  # who launched it: when that process dies, its ranks are orphans
    if nproc is None or nproc > 1:  # what torchrun sets for several ranks a node (without its warning); one rank
        env.setdefault("OMP_NUM_THREADS", "1")  # keeps torch's own thread count there, as plain torchrun does
    # Spans (labkit.spans): the boot folder's sitecustomize records every action's two ends in any
    # rank that pipelines, a user's own script too; written to <run dir>/spans/rank<N>.jsonl.
    env[SPANS_DIR_VAR] = str((run_dir / "spans").resolve())
    env["PYTHONPATH"] = os.pathsep.join([str(BOOT_DIR), *filter(None, [env.get("PYTHONPATH")])])
    if pp_logs:
        env["TORCH_LOGS"] = merge_torch_logs(env.get("TORCH_LOGS"))
        env.setdefault("TORCH_LOGS_FORMAT", PP_LOG_FORMAT)  # a user's own format is kept (see kit_changes)
    env.update(extra or {})
    return env


def merge_torch_logs(user: str | None) -> str:
    """The user's TORCH_LOGS with the pipelining logs at DEBUG added (`+pp`), theirs kept as they wrote
    them: "recompiles" -> "recompiles,+pp"; a setting of their own for pp ("+pp", "pp", "-pp") is left
    as it is (then the logs hold what they asked for)."""
    parts = [p.strip() for p in (user or "").split(",") if p.strip()]
    if any(p.lstrip("+-") == "pp" for p in parts):
        return ",".join(parts)
    return ",".join([*parts, "+pp"])


SECRET_VARS = ("LABKIT_RANKS_SECRET",)
"""Variables whose values command.txt never shows (the live ranks' channel secret)."""


def kit_changes(env: dict, base: dict | None = None) -> list[str]:
    """What the ranks' environment `env` adds to or changes from `base` (the launching process's), one
    line a variable: `NAME=value` (added) or `NAME=value (was: theirs)`; secrets shown as <secret>."""
    base = dict(os.environ) if base is None else base
    out = []
    for name in sorted(env):
        if base.get(name) == env[name]:
            continue
        value = "<secret>" if name in SECRET_VARS else env[name]
        was = f" (was: {base[name]})" if name in base else ""
        out.append(f"{name}={value}{was}")
    return out


def command_text(cmd: list[str], env: dict, warm: bool = True, base: dict | None = None) -> str:
    """command.txt: the plain torchrun command (one line, to copy), after comment lines that say exactly
    how the kit's processes differ from what that command alone would start: the environment added or
    changed, variable by variable, when `warm`, that the launcher ran as `labkit.launching.warm` (torchrun's own
    agent, its ranks forks of a process that had imported torch), and, where the spans' boot folder is on the
    ranks' path, what its sitecustomize does in each rank."""
    lines = ["# The plain torchrun command below runs the same script with the same arguments. The kit's ranks",
             "# differed from what it alone starts in these ways, and no other:"]
    if warm:
        lines.append("#   launcher: python -m labkit.launching.warm (torchrun's own agent and arguments; each rank a "
                     "fork of a process that had imported torch; LABKIT_START_METHOD=spawn starts them fresh)")
    if env.get(SPANS_DIR_VAR) and str(BOOT_DIR) in env.get("PYTHONPATH", "").split(os.pathsep):
        lines.append("#   in each rank: the kit's sitecustomize (the PYTHONPATH folder below) wraps torch's pipelining "
                     "stage and schedule methods to record spans, inputs' fingerprints and each step's losses and "
                     "gradient norms (labkit.spans.record; LABKIT_SPANS=0 turns them off), and runs torch's imports "
                     "with Python's collector paused, freezing what they made (labkit.core.startup; "
                     "LABKIT_GC_PAUSE=0 turns it off)")
    changes = kit_changes(env, base)
    lines += [f"#   env: {c}" for c in changes] or ["#   env: nothing added or changed"]
    return "\n".join(lines) + "\n" + shlex.join(cmd) + "\n"


def validate_nodes(nnodes: int, node_rank: int, rdzv_endpoint: str | None) -> None:
    for name, v, lo in (("nnodes", nnodes, 1), ("node_rank", node_rank, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ConfigError(f"{name} must be a whole number >= {lo}, got {v!r}.")
    if node_rank >= nnodes:
        raise ConfigError(f"node_rank {node_rank} must be below nnodes {nnodes} (nodes are numbered from 0).")
    if nnodes > 1 and not rdzv_endpoint:
        raise ConfigError("A multi-node job needs --rdzv-endpoint HOST:PORT (the first node's address, reachable "
                          "from every node); run the same command on each node with its own --node-rank.")
    if rdzv_endpoint is not None:
        host, _, port = rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"--rdzv-endpoint must look like HOST:PORT (e.g. node001:29400), got {rdzv_endpoint!r}.")


def preflight_torch() -> None:
    """The installed torch held to `config.validate_torch` (the supported range), read from its
    metadata without importing it."""
    from importlib import metadata

    from ..config.run import validate_torch

    try:
        version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        return
    validate_torch(version)


def preflight_device(device: str, nproc: int) -> None:
    """`--device cuda` needs a GPU per local rank (NCCL refuses two ranks on one GPU): say so before launching."""
    if device != "cuda":
        return
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < nproc:
        raise ConfigError(
            f"--device cuda with {nproc} ranks on this node needs {nproc} GPUs, but {gpus} are visible "
            f"(NCCL refuses two ranks on one GPU). Use --nproc {max(gpus, 1)} with a multi-stage schedule "
            f"(all stages on one rank), or --device cpu.")
