"""Helpers for code that runs *inside* a torchrun rank (the jobs in `labkit.jobs` and live ranks use these).

Owns: choosing the device and backend, process-group set-up with a short timeout, clean
teardown (barrier before destroy), per-rank peak memory, small cross-rank reductions with
tensors (no pickling), progress lines the launcher understands, atomic JSON writes, and
switching torch's pipelining logger on and off step by step (the capture-overhead benchmark).
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

PROGRESS_PREFIX = "[labkit] progress "
PP_LOGGER = "torch.distributed.pipelining"  # what TORCH_LOGS=+pp sets to DEBUG


def pp_logs_on_step(step: int) -> bool:
    """The capture-overhead A/B inside one job: steps pair up (0,1), (2,3), ... and within each
    pair one step logs and the other does not, the order alternating pair by pair (on off, off on,
    on off, ...), so neither a warm-up trend nor drift in the machine's speed favours either side."""
    return step % 4 in (0, 3)


class PPLogSwitch:
    """Turns torch's pipelining debug logs off (WARNING) and back on (the level TORCH_LOGS gave)
    between steps. With the logger at WARNING a `logger.debug(...)` call returns at once, so an
    "off" step costs what a job without TORCH_LOGS=+pp costs."""

    def __init__(self) -> None:
        self.logger = logging.getLogger(PP_LOGGER)
        self.level = self.logger.level

    def set(self, on: bool) -> None:
        self.logger.setLevel(self.level if on else logging.WARNING)


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str


def choose_device(requested: str, local_rank: int, local_world_size: int) -> torch.device:
    """`cuda` needs one GPU per local rank (NCCL refuses two ranks on one GPU); `auto` falls back to cpu."""
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "cpu":
        return torch.device("cpu")
    if n_gpus >= local_world_size and n_gpus > 0:
        return torch.device(f"cuda:{local_rank}")
    if requested == "cuda":
        raise RuntimeError(
            f"--device cuda needs one GPU per rank: {local_world_size} ranks on this node but "
            f"{n_gpus} GPU(s) visible. Use fewer ranks (a multi-stage schedule runs all stages on "
            f"one rank), or --device cpu."
        )
    return torch.device("cpu")


def init_distributed(device: str = "auto", timeout_s: float = 60.0) -> DistInfo:
    """Join the torchrun job: nccl on one GPU per rank, else gloo on CPU; a short timeout. The rank
    gets SIGTERM when its torchrun agent dies (even by SIGKILL): no orphans. Older torch gets the
    kit's workarounds first (`versions.apply_workarounds`)."""
    from ..core.processes import set_parent_death_signal
    from ..versions import apply_workarounds

    set_parent_death_signal()
    apply_workarounds()
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    dev = choose_device(device, local_rank, local_world)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    kwargs = {}
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        kwargs["device_id"] = dev
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s), **kwargs)
    return DistInfo(rank, world, local_rank, local_world, dev, backend)


def teardown() -> None:
    """Barrier, then destroy: a rank that destroys its group while a peer's small send to it is still in
    flight can leave that peer's teardown hanging (seen with gloo on CPU ranks)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def quiet_warnings() -> None:
    """Hide torch's own pytree deprecation warning, which the tracer prints on every rank (noise for learners)."""
    import warnings

    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*", category=FutureWarning)
    # FSDP2 warns once per rank when a wrapped stage returns a view (the tutorial model's first stage
    # transposes): an in-place op on it would skip the pre-backward hook. The schedule only sends it
    # or feeds it to the loss, never in place, and each run's check compares every gradient.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor", category=UserWarning)


def exit_now(code: int | None) -> None:
    """End the rank now, after the process group is torn down and output flushed, skipping the
    interpreter's own teardown: under load, destroying leftover pipelining objects at exit sometimes
    aborted a rank ("terminate called without an active exception", exit -6) after it had finished. The kit's
    records still due (the last step's span lines, labkit.spans.record.write_all) are written first."""
    record = sys.modules.get("labkit.spans.record")
    if record is not None:
        record.write_all()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int:
    """GPU: peak allocated by torch since the last reset. CPU: the process's peak RSS (a high-water mark)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def all_gather_floats(values: list[float], device: torch.device, group=None) -> list[list[float]]:
    """Every rank's list of floats (all lists the same length), as plain Python lists, in rank order
    (ranks of `group`, the whole job by default)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t, group=group)
    return [o.cpu().tolist() for o in out]


def broadcast_floats(values: list[float] | None, n: int, src: int, device: torch.device, group=None) -> list[float]:
    """`values` (length n) from rank `src` (a rank of `group`, the whole job by default) to every rank."""
    t = torch.tensor(values if values is not None else [0.0] * n, dtype=torch.float64, device=device)
    dist.broadcast(t, dist.get_global_rank(group, src) if group is not None else src, group=group)
    return t.cpu().tolist()


def progress(done: int, total: int, what: str = "step") -> None:
    """A line the launcher turns into a progress bar (printed by rank 0 only)."""
    print(f"{PROGRESS_PREFIX}{done}/{total} {what}", flush=True)


@contextmanager
def maybe_profile(enabled: bool, d: "DistInfo", out_dir: str | os.PathLike):
    """torch.profiler around the block when enabled; the trace goes to `out_dir/profile/rank<N>.json`."""
    if not enabled:
        yield None
        return
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if d.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        yield prof
    path = Path(out_dir) / "profile" / f"rank{d.rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))


ANNOTATION_PREFIX = "labkit::"


def annotate_stages(stages: list) -> None:
    """Name each stage's compute in profiler traces: `labkit::<stage><kind><microbatch>` (e.g. `labkit::1B3`).

    Wraps the stage's `forward_one_chunk` (F), `backward_one_chunk` (B, or I when the schedule splits
    the backward) and `backward_weight_one_chunk` (W). The waits for incoming tensors happen outside
    these calls, so the spans are pure compute, for every schedule (torch's own `record_function`
    names cover GPipe and the multi-stage runtime, but not 1F1B). Used with --profile only.
    """
    from torch.profiler import record_function

    def wrap(stage, name, kind_of):
        inner = getattr(stage, name)

        def wrapper(chunk_id, *args, **kwargs):
            kind = kind_of(args, kwargs)
            with record_function(f"{ANNOTATION_PREFIX}{stage.stage_index}{kind}{chunk_id}"):
                return inner(chunk_id, *args, **kwargs)

        setattr(stage, name, wrapper)

    def backward_kind(args, kwargs):
        full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
        return "B" if full else "I"

    for st in stages:
        wrap(st, "forward_one_chunk", lambda a, k: "F")
        wrap(st, "backward_one_chunk", backward_kind)
        if hasattr(st, "backward_weight_one_chunk"):
            wrap(st, "backward_weight_one_chunk", lambda a, k: "W")


@contextmanager
def timed(device: torch.device):
    """Wall time of the block in seconds (GPU work synchronised at both ends): `with timed(d) as t: ...; t()`."""
    sync(device)
    start = time.perf_counter()
    box = [0.0]
    yield lambda: box[0]
    sync(device)
    box[0] = time.perf_counter() - start


def write_json(path: str | os.PathLike, data: dict) -> None:
    """Write atomically (temp file + rename), so a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False))
    os.replace(tmp, path)


def run_dir(override: str | os.PathLike | None = None) -> Path:
    """Where a job writes: `override`, else the run directory the launcher set ($LABKIT_RUN_DIR), else here."""
    return Path(override or os.environ.get("LABKIT_RUN_DIR") or ".")


def noise_fields(check) -> dict:
    """The check's float-noise figures for result.json (labkit.check.noise): the worst ratio to the
    measured floor, the limit, where it went wrong, and the 10 tensors with the largest ratios."""
    figs = sorted(getattr(check, "figures", []), key=lambda f: -f.ratio)
    return {"multiple": getattr(check, "noise_multiple", None), "worst_ratio": figs[0].ratio if figs else None,
            "within": all(f.ratio <= check.noise_multiple for f in figs) if figs else None,
            "where": getattr(check, "where", ""), "no_grad": getattr(check, "no_grad", []),
            "notes": getattr(check, "notes", []), "worst": [f.as_dict() for f in figs[:10]]}


def write_result(out_dir: str | os.PathLike, d: "DistInfo", check, **fields) -> None:
    """result.json of a kit job (rank 0): the job's own fields, the reference check, versions and device."""
    import platform

    write_json(Path(out_dir) / "result.json", {
        "status": "ok" if check.ok else "failed", "failure": check.failure, **fields,
        "losses": check.losses, "reference_losses": check.reference_losses,
        "reference_match": check.ok, "max_abs_diff": check.max_abs_diff, "tolerance": check.tolerance,
        "max_abs_diff_losses": check.max_abs_diff_losses, "max_abs_diff_grads": check.max_abs_diff_grads,
        "max_abs_diff_outputs": check.max_abs_diff_outputs,
        "compared_param_elements": check.compared, "model_param_elements": check.expected,
        "noise": noise_fields(check),
        "device": str(d.device), "backend": d.backend, "torch": torch.__version__,
        "python": platform.python_version(),
    })
