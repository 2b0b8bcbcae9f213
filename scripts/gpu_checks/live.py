"""Parts 4-5 on one live pool of one rank (`labkit.Ranks`): a pipelined step against the unsplit model, its
spans, and the run watch (a clean run, a lost optimizer state named at its step); then the memory tracker
against the bytes the step saves (and, on a GPU, the allocator)."""

from __future__ import annotations

import time

from .common import FAIL, MIN_JOB_S, PASS, Check, first_line


STEP_CELL = """
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B
from labkit.check.reference import check_step

torch.manual_seed(0)
full = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(4)]).to(device)
x, y = torch.randn(8, 32, device=device), torch.randn(8, 32, device=device)
stages = [PipelineStage(full[2 * s:2 * s + 2], s, 2, device) for s in range(2)]  # both stages on this rank
sched = ScheduleInterleaved1F1B(stages, n_microbatches=4, loss_fn=nn.functional.mse_loss)
losses = []
cuda = device.type == "cuda"
if cuda:  # the step's own peak on the device, above what the rank held before it
    torch.cuda.synchronize(device); base = torch.cuda.memory_allocated(device); torch.cuda.reset_peak_memory_stats(device)
sched.step(x, target=y, losses=losses)
step_peak = torch.cuda.max_memory_allocated(device) - base if cuda else None
check = check_step(full, stages, x, y, losses, 4, nn.functional.mse_loss, device=device)
# check_stages on the same step: its slices (copies of the unsplit model's parts, not the stages), its float64
# and microbatched references on the host, and the saved tensors of R's recomputed blocks (labkit.check.pieces,
# offload); what it adds to the device above what the rank held before it
from labkit import check_stages
import copy as _copy
slices = {s: _copy.deepcopy(full[2 * s:2 * s + 2]) for s in range(2)}
if cuda:
    torch.cuda.synchronize(device); base = torch.cuda.memory_allocated(device); torch.cuda.reset_peak_memory_stats(device)
staged = check_stages(slices, stages, x, y, losses, 4, nn.functional.mse_loss)
check_added = torch.cuda.max_memory_allocated(device) - base if cuda else None
{"ok": check.ok, "max_abs_diff": check.max_abs_diff, "stages_ok": staged.ok, "stages_worst": staged.worst_ratio,
 "step_peak_bytes": step_peak, "check_stages_added_bytes": check_added,
 "backend": dist.get_backend(), "device": str(device),
 "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
 "torch": torch.__version__, "cuda": torch.version.cuda}
"""

WATCH_CELL = """
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B
# the run watch (labkit.watch_run) over 6 steps of AdamW, checked every 2: clean, and with the optimizer's state
# lost at step 3 (named there, stage 0); on a GPU the state's step counts stay on the host beside the moments
import labkit


def watched(bug):
    torch.manual_seed(1)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(4)]).to(device)
    both = [PipelineStage(net[2 * s:2 * s + 2], s, 2, device) for s in range(2)]
    run = ScheduleInterleaved1F1B(both, n_microbatches=4, loss_fn=nn.functional.mse_loss)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.1)
    watch = labkit.watch_run(both, opt, nn.functional.mse_loss, 4, full=net, every=2)
    g = torch.Generator().manual_seed(2)
    try:
        for t in range(6):
            xb, yb = torch.randn(8, 32, generator=g).to(device), torch.randn(8, 32, generator=g).to(device)
            watch.begin(xb, yb)
            opt.zero_grad()
            got = []
            run.step(xb, target=yb, losses=got)
            if bug and t == 3:
                opt.state.clear()
            opt.step()
            watch.end(got)
    finally:
        watch.close()
    return [watch.report.ok, watch.report.first_wrong_step, watch.report.stage, watch.report.failure or ""]


{"watch_clean": watched(False), "watch_bug": watched(True)}
"""

MEMORY_CELL = """
import copy
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, ScheduleLoopedBFS
from labkit.worker.memory import SavedTensorTracker, saved_activation_bytes

D, B, M = 512, 256, 4
cuda = device.type == "cuda"
torch.manual_seed(0)
full = nn.Sequential(*[nn.Sequential(nn.Linear(D, D), nn.ReLU()) for _ in range(4)]).to(device)
x, y = torch.randn(B, D, device=device), torch.randn(B, D, device=device)


def pipeline(model):
    parts = [model[0:2], model[2:4]]
    stages = [PipelineStage(p, s, 2, device) for s, p in enumerate(parts)]
    return parts, stages, ScheduleLoopedBFS(stages, n_microbatches=M, loss_fn=nn.functional.mse_loss)


def held(events):
    now, peak = {}, 0
    for _, st, b, _ in events:
        now[st] = b
        peak = max(peak, sum(now.values()))
    return sum(now.values()), peak


parts, stages, sched = pipeline(full)
h = parts[0](x).detach().requires_grad_()
# what the step saves by construction: LoopedBFS on one rank runs every forward before any backward,
# so at its peak the rank holds both stages' saved tensors for the whole batch
expected = saved_activation_bytes(parts[0], x) + saved_activation_bytes(parts[1], h)
del h
sched.step(x, target=y, losses=[])  # a warm step: a first step may also run a forward of torch's own
full.zero_grad(set_to_none=True)
tracker = SavedTensorTracker(stages)
if cuda:
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
sched.step(x, target=y, losses=[])  # the measured step
if cuda:
    torch.cuda.synchronize(device)
    cuda_peak = torch.cuda.max_memory_allocated(device) - base
left, peak = held(tracker.events)
# what a pipeline's FIRST step leaves held (torch 2.15 keeps its metadata inference's forward alive)
probe_parts, probe_stages, probe_sched = pipeline(copy.deepcopy(full))
probe = SavedTensorTracker(probe_stages)
probe_sched.step(x, target=y, losses=[])
first_left, first_peak = held(probe.events)
{"expected_bytes": expected, "peak_bytes": peak, "held_after_step": left, "events": len(tracker.events),
 "input_bytes": x.numel() * x.element_size(),
 "grad_bytes": sum(p.numel() * p.element_size() for p in full.parameters()),
 "allocator_readings": sum(e[3] is not None for e in tracker.events),
 "cuda_max_allocated_above_start_bytes": cuda_peak if cuda else None,
 "first_step_peak_bytes": first_peak, "held_after_first_step": first_left,
 "sizes": {"dim": D, "batch": B, "microbatches": M}}
"""


def run_live(check: Check) -> None:
    """Parts 4 and 5 on one live pool of one rank."""
    from labkit.ranks import Ranks

    t0 = time.monotonic()
    deadline = check.parts["4_live_ranks"].deadline_s
    if check.left() < MIN_JOB_S:
        check.not_run(["4_live_ranks", "5_memory"], "the check's time budget was spent")
        return
    try:
        pool = Ranks(nproc=1, device=check.device, out=check.out / "live", live="print",
                     start_timeout=min(deadline, check.left()), timeout=min(deadline, check.left()))
    except Exception as e:
        check.jobs.append({"what": "live pool (parts 4, 5)", "status": "did not start", "processes": 2})
        check.conclude("4_live_ranks", FAIL, f"the pool did not start: {first_line(e)}", time.monotonic() - t0,
                       error=str(e)[-3000:])
        check.not_run(["5_memory"], "the live pool did not start (part 4)")
        return
    try:
        live_step(check, pool, t0)
        live_memory(check, pool)
    finally:
        pool.close()
        check.jobs.append({"what": "live pool (parts 4, 5)", "run_dir": str(pool.run_dir), "status": "closed",
                           "seconds": round(time.monotonic() - t0, 1), "restarts": pool.restarts,
                           "processes": 2 * (pool.restarts + 1)})
        check.save()



def cell_timeout(check: Check, key: str, t0: float) -> float:
    return max(1.0, min(check.parts[key].deadline_s - (time.monotonic() - t0), check.left()))


def live_step(check: Check, pool, t0: float) -> None:
    """Part 4: a pipelined step (Interleaved1F1B, 2 stages x 4 microbatches) on the pool's rank against the
    unsplit model, its backend (nccl on a GPU, gloo on CPU) and its spans' 16 actions; concludes the part."""
    expected_backend = "nccl" if check.device == "cuda" else "gloo"
    try:
        got = pool.exec(STEP_CELL, timeout=cell_timeout(check, "4_live_ranks", t0))[0]
        counts = {f"{st}{kind}": n for (st, kind), n in sorted(pool.timeline().counts().items())}
        got.update(pool.exec(WATCH_CELL, timeout=cell_timeout(check, "4_live_ranks", t0))[0])
    except Exception as e:
        check.conclude("4_live_ranks", FAIL, f"the cell failed: {first_line(e)}", time.monotonic() - t0,
                       error=str(e)[-3000:], backend=pool.status().get("backend"))
        return
    want = {"0F": 4, "0B": 4, "1F": 4, "1B": 4}
    problems = []
    if got["backend"] != expected_backend:
        problems.append(f"backend {got['backend']}, expected {expected_backend}")
    if not got["ok"]:
        problems.append(f"the step DOES NOT match the unsplit model (max abs diff {got['max_abs_diff']:.2e})")
    if counts != want:
        problems.append(f"the cell's spans count {counts}, expected {want}")
    problems += stages_problems(got)
    if got["watch_clean"][0] is not True:
        problems.append(f"the run watch failed a clean run: {got['watch_clean']}")
    if got["watch_bug"][:3] != [False, 3, 0]:
        problems.append(f"the run watch did not name the lost optimizer state at step 3, stage 0: {got['watch_bug']}")
    if check.device == "cuda" and got.get("device_name"):
        check.env["device_name"] = got["device_name"]  # torch's name for it, from the rank that used it
    why = "; ".join(problems) or (f"{got['backend']} on {got['device']}: Interleaved1F1B, 2 stages x 4 microbatches "
                                  f"match the unsplit model (max abs diff {got['max_abs_diff']:.2e}); the cell's spans "
                                  f"hold its 16 actions; {stages_text(got)}")
    check.conclude("4_live_ranks", FAIL if problems else PASS, why, time.monotonic() - t0, rank=got, span_counts=counts,
                   run_dir=str(pool.run_dir))


def stages_problems(got: dict) -> list[str]:
    """check_stages on the part's step: it must pass, and on a GPU add at most half the step's own peak to the
    device (its float64 and microbatched references run on the host: labkit.check.stagewise)."""
    problems = [] if got.get("stages_ok") else [f"check_stages failed the correct step (worst "
                                                f"{got.get('stages_worst', float('nan')):.2g}x its floor)"]
    step, added = got.get("step_peak_bytes"), got.get("check_stages_added_bytes")
    if step and added is not None and added > 0.5 * step:
        problems.append(f"check_stages added {added / 2 ** 20:.2f} MiB to the device, more than half the step's "
                        f"own peak ({step / 2 ** 20:.2f} MiB)")
    return problems


def stages_text(got: dict) -> str:
    step, added = got.get("step_peak_bytes"), got.get("check_stages_added_bytes")
    text = f"check_stages passes it (worst {got.get('stages_worst', 0):.2g}x its floor)"
    if step:
        text += (f", adding {added / 2 ** 20:.2f} MiB to the device against the step's own peak of "
                 f"{step / 2 ** 20:.2f} MiB ({added / step:.2f}x)")
    return text


def live_memory(check: Check, pool) -> None:
    """Part 5: the memory tracker over a warm step on the same pool, judged by `memory_verdict`; concludes
    the part with the cell's readings as its figures."""
    t0 = time.monotonic()
    if check.left() < MIN_JOB_S / 2:
        check.not_run(["5_memory"], "the check's time budget was spent")
        return
    try:
        m = pool.exec(MEMORY_CELL, timeout=cell_timeout(check, "5_memory", t0))[0]
    except Exception as e:
        check.conclude("5_memory", FAIL, f"the cell failed: {first_line(e)}", time.monotonic() - t0,
                       error=str(e)[-3000:])
        return
    verdict, why = memory_verdict(m, check.device)
    check.conclude("5_memory", verdict, why, time.monotonic() - t0, **m)


def memory_verdict(m: dict, device: str) -> tuple[str, str]:
    """The tracker's peak over a warm step must be the bytes the step saves by construction, and it must
    let all of them go by the step's end; on CUDA the allocator's peak above the step's start must hold
    at least that much."""
    mib = 2 ** 20
    problems = []
    if abs(m["peak_bytes"] - m["expected_bytes"]) > 0.01 * m["expected_bytes"]:
        problems.append(f"tracker peak {m['peak_bytes'] / mib:.2f} MiB, expected {m['expected_bytes'] / mib:.2f} MiB")
    if m["held_after_step"]:
        problems.append(f"{m['held_after_step']} bytes still held after the step")
    text = (f"tracker peak {m['peak_bytes'] / mib:.2f} MiB = the step's saved tensors "
            f"({m['expected_bytes'] / mib:.2f} MiB)")
    if device == "cuda":  # the batch (the first stage's saved input) was allocated before the step began
        cuda_peak, new = m["cuda_max_allocated_above_start_bytes"], m["peak_bytes"] - m["input_bytes"]
        if cuda_peak < new:
            problems.append(f"max_memory_allocated rose {cuda_peak / mib:.2f} MiB, less than the "
                            f"{new / mib:.2f} MiB the tracker saw allocated during the step")
        if not m["allocator_readings"]:
            problems.append("no event carries torch.cuda.memory_allocated")
        text += (f"; torch.cuda.max_memory_allocated rose {cuda_peak / mib:.2f} MiB: the {new / mib:.2f} MiB "
                 f"the tracker saw allocated in the step ({new / max(cuda_peak, 1):.0%}), gradients "
                 f"({m['grad_bytes'] / mib:.2f} MiB) and temporaries")
    else:
        text += "; the comparison with torch.cuda.max_memory_allocated is GPU-only"
    if m["held_after_first_step"]:
        text += (f"; a pipeline's first step leaves {m['held_after_first_step'] / mib:.2f} MiB held (a forward "
                 f"of torch's own)")
    return (FAIL if problems else PASS), ("; ".join(problems) if problems else text)
