"""The check's cost: one 1F1B step on 2 CPU ranks (a warm labkit.Ranks pool), then `labkit.check_step` (the
whole model on every rank) and `labkit.check_stages` (each rank's slices only) of it, per rank: wall
time, CPU time and peak memory (the rank's RSS high-water mark above what it held before), medians of several
rounds with the checks' order alternating, then rounds with a bug planted so that both fail. Also RESULTS.md's
section for it (how, a reading, a row per rank)."""

from __future__ import annotations

import os
import statistics
import tempfile
import textwrap

from . import common

CHECK_HEADING = "labkit/check/stagewise.py and boundaries.py: the check's cost"
CHECK_MODELS = {"small_lm": {"dim": 256, "n_blocks": 8, "batch": 16, "seq": 64},
                "llama": {"dim": 256, "n_blocks": 8, "batch": 16, "seq": 64}}
CHECK_SETUP = textwrap.dedent("""
    import ctypes, dataclasses, gc, re, time
    import torch, torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    import labkit

    M = 4  # microbatches
    size = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())

    def rss():
        # (resident bytes, their high-water mark) of this process
        s = open("/proc/self/status").read()
        return tuple(int(re.search(k + r":\\s+(\\d+) kB", s).group(1)) * 1024 for k in ("VmRSS", "VmHWM"))

    def measured(fn):
        # fn()'s value, wall and CPU time (the rank's threads) and peak resident bytes above what the rank held
        # just before (what was free handed back to the system first, so that the call cannot reuse it unseen)
        gc.collect(); ctypes.CDLL(None).malloc_trim(0); dist.barrier()
        before = rss()[0]
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the high-water mark starts again from the resident set now
        t, cpu = time.perf_counter(), time.process_time()
        out = fn()
        return out, {"s": time.perf_counter() - t, "cpu_s": time.process_time() - cpu, "peak_bytes": rss()[1] - before}

    def small_lm_parts(dim, n_blocks, batch, seq):
        from labkit.models import cut_small_lm, lm_loss, small_lm
        blocks = list(range(rank * n_blocks // 2, (rank + 1) * n_blocks // 2))  # halves: stage = rank
        first, last = rank == 0, rank == 1
        full = small_lm(n_blocks, dim=dim)
        g = torch.Generator().manual_seed(0)
        x, y = (torch.randint(0, 128, (batch, seq), generator=g) for _ in range(2))
        return dict(full=full, stage=cut_small_lm(full, blocks, first, last), slice=small_lm(blocks=blocks, first=first,
                    last=last, dim=dim), x=x, y=y, kw={}, loss_fn=lm_loss, bug=f"blocks.{n_blocks - 1}.down")

    def llama_parts(dim, n_blocks, batch, seq):
        from labkit import PRESETS
        from labkit.models import hf
        pre = dataclasses.replace(PRESETS["small"], dim=dim, n_layers=n_blocks, batch_size=batch, seq_len=seq)
        bounds = [0, n_blocks // 2, n_blocks]
        x, y, kw = hf.make_batch("llama", pre, batch, 0)
        return dict(full=hf.meta_stage("llama", pre, 0, [0, n_blocks], device),
                    stage=hf.meta_stage("llama", pre, rank, bounds, device),
                    slice=hf.meta_stage("llama", pre, rank, bounds, device), x=x, y=y, kw=kw, loss_fn=hf.loss_fn,
                    bug=f"model.layers.{n_blocks - 1}.mlp.down_proj")

    def prepare(model, **sizes):
        # this rank's stage, its slice and the whole model; the bytes of parameters each holds
        global P, SCHED
        P = None; gc.collect()
        P = {"small_lm": small_lm_parts, "llama": llama_parts}[model](**sizes)
        P["pipe"] = PipelineStage(P["stage"], rank, 2, device)
        SCHED = Schedule1F1B(P["pipe"], M, loss_fn=P["loss_fn"])
        return {k: size(P[k]) for k in ("stage", "full", "slice")}

    def step():
        P["stage"].zero_grad(set_to_none=True)  # the step allocates its gradients, as after an optimizer's step
        losses = []
        SCHED.step(P["x"], **P["kw"]) if rank == 0 else SCHED.step(target=P["y"], losses=losses, **P["kw"])
        return losses

    def one_round(order, bug=False):
        # a step, then both checks of it in `order`; with `bug`, a 1% error in one module of the last stage
        hook = P["stage"].get_submodule(P["bug"]).register_forward_hook(lambda m, a, o: o * 1.01) \\
            if bug and rank == 1 else None
        out = {}
        losses, out["step"] = measured(step)
        args = ([P["pipe"]], P["x"], P["y"], losses, M, P["loss_fn"])
        checks = {"check_step": lambda: labkit.check_step(P["full"], *args, kwargs=P["kw"]),
                  "check_stages": lambda: labkit.check_stages({rank: P["slice"]}, *args, kwargs=P["kw"])}
        for name in order:
            check, out[name] = measured(checks[name])
            out[name]["ok"] = check.ok
        if hook is not None:
            hook.remove()
        return out
""")
CHECKS = ("check_step", "check_stages")
CHECK_PHASES = ("step", *CHECKS)


def _medians(rounds: list[dict]) -> dict:
    """{phase: median seconds, CPU seconds and peak bytes over the rounds, and in how many the check passed}."""
    return {p: {**{k: statistics.median(r[p][k] for r in rounds) for k in ("s", "cpu_s", "peak_bytes")},
                **({"passed": sum(r[p]["ok"] for r in rounds)} if "ok" in rounds[0][p] else {})}
            for p in CHECK_PHASES if p in rounds[0]}


def check_cost(models: dict = CHECK_MODELS, repeats: int = 5, failing: int = 3) -> dict:
    """Per rank, the wall time and peak memory of one 1F1B step (2 CPU ranks, 4 microbatches) and of
    `check_step` and `check_stages` on it, medians of `repeats` rounds (the checks' order alternating),
    each model on the same warm pool; then `failing` rounds with a 1% error planted in one module of the
    last stage (the checks fail and replay each stage in float64, labkit.check.boundaries)."""
    from labkit.ranks import Ranks

    orders = [("check_step", "check_stages"), ("check_stages", "check_step")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp, Ranks(nproc=2, device="cpu", runs_root=tmp, live="print") as pool:
        run = lambda call: pool.exec(call, timeout=600)  # noqa: E731
        microbatches = run(CHECK_SETUP + "M")[0]
        for model, sizes in models.items():
            held = run(f"prepare({model!r}, **{sizes!r})")
            if common.WARM_UP:  # read here, where tests clear it
                run(f"one_round({orders[0]!r})")
            good = [run(f"one_round({orders[i % 2]!r})") for i in range(repeats)]
            bad = [run(f"one_round({orders[i % 2]!r}, bug=True)") for i in range(failing)]
            ranks = {str(r): {"held_bytes": held[r], **_medians([g[r] for g in good]),
                              **({"failing": _medians([b[r] for b in bad])} if bad else {})} for r in sorted(held)}
            wrong = [f"rank {r}: {p}" for r, v in ranks.items() for p in CHECKS
                     if v[p]["passed"] < repeats or v.get("failing", {}).get(p, {}).get("passed")]
            if wrong:
                raise RuntimeError(f"{model}: a check passed with the planted bug or failed without it: {wrong}")
            rows.append({"model": model, **sizes, "microbatches": microbatches, "ranks": ranks})
    return {"models": rows, "repeats": repeats, "failing": failing}


def _span(values, unit: str = "x") -> str:
    """'1.2-3.4x' (the smallest and largest of `values`), or '1.2x' when they read the same."""
    lo, hi = f"{min(values):.1f}", f"{max(values):.1f}"
    return f"{lo}{unit}" if lo == hi else f"{lo}-{hi}{unit}"


def _check_cost_rows(cc: dict | None) -> list[str]:
    """RESULTS.md's section of the check's cost: how it was measured, a reading, a row per model and rank."""
    if not cc:
        return []
    ranks = [(m, r, v) for m in cc["models"] for r, v in m["ranks"].items()]
    return ["", f"## {CHECK_HEADING}", "", _check_cost_how(cc), "", _check_cost_reading(cc, [v for _, _, v in ranks]),
            "", "| model | rank | held: stage / whole model / slice | step: time, peak | check_step: time (x step), "
            "peak (x step) | check_stages: time (x step), peak (x step) | failing check_step: time above passing, peak "
            "| failing check_stages: time above passing, peak |", "| --- | --- | --- | --- | --- | --- | --- | --- |",
            *(_check_cost_row(m["model"], r, v) for m, r, v in ranks)]


def _mb(n: float) -> str:
    return f"{n / 2 ** 20:.0f} MB"


def _check_cost_how(cc: dict) -> str:
    models = "; ".join(f"{m['model']} (dim {m['dim']}, {m['n_blocks']} blocks, batch {m['batch']} x seq {m['seq']}"
                       + (", every part materialised from meta" if m["model"] == "llama" else "") + ")"
                       for m in cc["models"])
    when = f"; measured {cc['date']}, torch {cc['torch']}" if cc.get("date") else ""
    if cc.get("load"):
        when += (f", load average {cc['load'][0]} at the start and {cc['load'][1]} at the end on {os.cpu_count()} "
                 "cores (other work shares them: wall times scatter, CPU times less)")
    return (f"One 1F1B step on 2 CPU ranks (gloo, {cc['models'][0]['microbatches']} microbatches, a warm "
            "`labkit.Ranks` pool), then `labkit.check_step` and `labkit.check_stages` of it, per rank: wall "
            f"time, CPU time (the rank's threads) and peak memory, medians of {cc['repeats']} rounds (the checks' "
            f"order alternating){when}. Models: {models}. Peak memory is the rank process's resident set (RSS) "
            "high-water mark during the call minus its RSS just before (Linux VmHWM, reset through "
            "/proc/self/clear_refs, after gc.collect() and malloc_trim(0) handed back what was free): what the call "
            "adds to what the rank holds. The step's includes its gradients (set to None before it) and "
            "activations. 'held': the parameters' bytes of the rank's stage, of the whole model check_step needs on "
            "every rank, and of the slice check_stages needs instead; held before the call, so not in its peak.")


def _check_cost_reading(cc: dict, ranks: list[dict]) -> str:
    """The paragraph that reads the table, its figures the smallest and largest over models and ranks."""
    ratio = lambda a, b, k: _span([v[a][k] / v[b][k] for v in ranks])  # noqa: E731
    text = (f"Reading: check_step took {ratio('check_step', 'step', 's')} the step's wall time and "
            f"{ratio('check_step', 'step', 'peak_bytes')} its peak; check_stages {ratio('check_stages', 'step', 's')} "
            f"and {ratio('check_stages', 'step', 'peak_bytes')}. check_step runs the whole model on every rank three "
            "times on the whole batch (whole batch, microbatched, and a float64 copy); its peak is mostly those "
            "references' activations (the float64 run's at twice float32's bytes), far above the parameters' "
            "bytes. check_stages runs the same three references on each rank's slice only, layer by layer (the "
            "microbatched one first, a microbatch at a time; the whole-batch one reading each of its sums as it "
            "makes its own gradient, so that one reference's gradients are held at a time; each layer "
            "checkpointed, the float64 one cast as each module runs, float32 for a 16-bit step, and its backward "
            "recomputing each innermost layer a microbatch's piece of the batch at a time where the layer treats "
            "samples apart and that lowers its peak: labkit.check.pieces; each gradient read "
            "as it is made; freed memory handed back before each module runs: labkit.check.lean), chained along "
            "the pipeline: its peak was "
            f"{ratio('check_stages', 'check_step', 'peak_bytes')} "
            f"of check_step's and its CPU time {ratio('check_stages', 'check_step', 'cpu_s')}, since it follows the "
            f"stage, not the model; its wall time {ratio('check_stages', 'check_step', 's')}, since a rank waits "
            "while the other runs its part of the chain, where check_step's ranks compute side by side.")
    if not cc.get("failing"):
        return text
    cpu = [_span([v["failing"][p]["cpu_s"] - v[p]["cpu_s"] for v in ranks], " s") + f" of CPU to {p}" for p in CHECKS]
    rounds = f"medians of {cc['failing']} rounds" if cc["failing"] > 1 else "one round"
    return text + (f" Failing ({rounds}, a 1% error planted in one module of the last stage "
                   "by a forward hook): the checks then replay each stage in float64, every module's input and output "
                   "held against the reference's (labkit.check.boundaries, located), which added "
                   f"{' and '.join(cpu)}, at "
                   + " and ".join(_span([v["failing"][p]["peak_bytes"] / v[p]["peak_bytes"] for v in ranks])
                                  for p in CHECKS) + " their passing peaks.")


def _check_cost_row(model: str, rank: str, v: dict) -> str:
    held, step = v["held_bytes"], v["step"]
    check = lambda c: (f"{c['s']:.2f} s ({c['s'] / step['s']:.1f}x; CPU {c['cpu_s']:.2f} s), "  # noqa: E731
                       f"{_mb(c['peak_bytes'])} ({c['peak_bytes'] / step['peak_bytes']:.1f}x)")
    failed = lambda p, f: (f"+{f['s'] - v[p]['s']:.2f} s (CPU +{f['cpu_s'] - v[p]['cpu_s']:.2f} s), "  # noqa: E731
                           f"{_mb(f['peak_bytes'])}" if f else "-")
    return (f"| {model} | {rank} | {_mb(held['stage'])} / {_mb(held['full'])} / {_mb(held['slice'])} | "
            f"{step['s']:.2f} s (CPU {step['cpu_s']:.2f} s), {_mb(step['peak_bytes'])} | {check(v['check_step'])} | "
            f"{check(v['check_stages'])} | " + " | ".join(failed(p, v.get("failing", {}).get(p)) for p in CHECKS)
            + " |")
