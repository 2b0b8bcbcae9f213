"""The check at scale: a transformers Llama of about 1B parameters, built from its config, each of 4 CPU ranks
materialising only its own stage and its slice from `meta` (labkit.models.hf.meta_stage), stepped with
Schedule1F1B and checked by `labkit.check_stages`; per rank the wall time, CPU time and peak memory of
the step and of the check (the rank's RSS high-water mark above what it held just before, as check_cost
measures it), and what `labkit.check_step` says before it starts (it would need the whole model and its
references on every rank: labkit.check.fits). Also RESULTS.md's section for it."""

from __future__ import annotations

import tempfile
import textwrap

from .check_cost import CHECK_SETUP, _mb

SCALE_HEADING = "labkit/check/stagewise.py at scale: a 1B-parameter Llama checked over 4 CPU ranks"
SCALE_SIZES = {"dim": 2048, "n_layers": 14, "n_heads": 16, "vocab": 8192, "batch": 4, "seq": 64, "microbatches": 4,
               "dtype": "bfloat16"}
"""0.97B parameters. In bfloat16: in float32 the ranks' stages, slices and gradients alone would hold 12 GB, and
with the check's peak (up to twice the step's) the 4 ranks would pass this machine's 24 GB."""
# the check's cost's imports and measurement on the rank (rss, measured), then the scale's own
SCALE_SETUP = CHECK_SETUP + textwrap.dedent("""
    from labkit import PRESETS
    from labkit.models import hf

    def scale_round(dim, n_layers, n_heads, vocab, batch, seq, microbatches, dtype="float32"):
        pre = dataclasses.replace(PRESETS["small"], dim=dim, n_layers=n_layers, n_heads=n_heads, vocab_size=vocab,
                                  batch_size=batch, seq_len=seq)
        n = dist.get_world_size()
        bounds = [round(i * n_layers / n) for i in range(n + 1)]
        whole = sum(p.numel() for p in hf.build_hf("llama", pre, device="meta").parameters())
        module = hf.meta_stage("llama", pre, rank, bounds, device).to(getattr(torch, dtype))
        slices = {rank: hf.meta_stage("llama", pre, rank, bounds, device).to(getattr(torch, dtype))}
        x, y, kw = hf.make_batch("llama", pre, batch, 0)
        stage = PipelineStage(module, rank, n, device)
        schedule = Schedule1F1B(stage, microbatches, loss_fn=hf.loss_fn)
        losses = []
        def step():
            if rank == 0:
                schedule.step(x, **kw)
            elif rank == n - 1:
                schedule.step(target=y, losses=losses, **kw)
            else:
                schedule.step(**kw)
        _, step_cost = measured(step)
        check, check_cost = measured(lambda: labkit.check_stages(slices, [stage], x, y, losses, microbatches,
                                                                        hf.loss_fn, kwargs=kw))
        from labkit.check.fits import too_large
        refused = too_large(hf.build_hf("llama", pre, device="meta").to(getattr(torch, dtype)), device)
        held = sum(p.numel() for p in module.parameters())
        return {"whole_params": whole, "stage_params": held, "ok": check.ok, "compared": check.compared,
                "expected": check.expected, "step": step_cost, "check_stages": check_cost,
                "check_step_refused": refused}
""")


def check_scale(sizes: dict = SCALE_SIZES, nproc: int = 4) -> dict:
    """One step and its check on `nproc` warm CPU ranks, per rank (see the module docstring)."""
    from labkit.ranks import Ranks

    with tempfile.TemporaryDirectory() as tmp, Ranks(nproc=nproc, device="cpu", runs_root=tmp, live="print") as pool:
        pool.exec(SCALE_SETUP)
        ranks = pool.exec(f"scale_round(**{sizes!r})", timeout=3600)
    return {**sizes, "ranks": {str(r): v for r, v in sorted(ranks.items())}}


def _check_scale_rows(cs: dict | None) -> list[str]:
    """RESULTS.md's section: how, a reading, a row per rank."""
    if not cs:
        return []
    ranks = cs["ranks"]
    first = next(iter(ranks.values()))
    ratio = [v["check_stages"]["peak_bytes"] / v["step"]["peak_bytes"] for v in ranks.values()]
    times = [v["check_stages"]["s"] / v["step"]["s"] for v in ranks.values()]
    when = f"; measured {cs['date']}, torch {cs['torch']}" if cs.get("date") else ""
    if cs.get("load"):
        when += f", load average {cs['load'][0]} at the start and {cs['load'][1]} at the end"
    how = (f"A transformers Llama from its config (hidden {cs['dim']}, {cs['n_layers']} layers, {cs['n_heads']} heads, "
           f"vocabulary {cs['vocab']}: {first['whole_params'] / 1e9:.2f}B parameters, counted on meta, in "
           f"{cs.get('dtype', 'float32')}), cut into "
           f"{len(ranks)} stages over {len(ranks)} warm CPU ranks (gloo), each rank materialising only its stage and "
           f"its slice from meta; one Schedule1F1B step of {cs['batch']} sequences of {cs['seq']} tokens in "
           f"{cs['microbatches']} microbatches, then labkit.check_stages{when}. Peak memory: the rank's RSS "
           "high-water mark during the call above its RSS just before (as in the check's cost above).")
    passed = all(v["ok"] and v["compared"] == v["expected"] for v in ranks.values())
    reading = (f"Reading: the check {'passed with every parameter compared' if passed else 'DID NOT pass'}; its peak "
               f"was {min(ratio):.1f}-{max(ratio):.1f}x the step's and its time {min(times):.1f}-{max(times):.1f}x.")
    if first["check_step_refused"]:
        reading += (" check_step, asked for the same step, refuses before it starts: "
                    f"\"{first['check_step_refused'].split(': check this step')[0]}\".")
    rows = [f"| {r} | {v['stage_params'] / 1e6:.0f}M | {v['step']['s']:.1f} s, {_mb(v['step']['peak_bytes'])} | "
            f"{v['check_stages']['s']:.1f} s, {_mb(v['check_stages']['peak_bytes'])} "
            f"({v['check_stages']['peak_bytes'] / v['step']['peak_bytes']:.1f}x) | {v['ok']} |"
            for r, v in ranks.items()]
    return ["", f"## {SCALE_HEADING}", "", how, "", reading, "",
            "| rank | stage parameters | step: time, peak | check_stages: time, peak (x step) | passed |",
            "| --- | --- | --- | --- | --- |", *rows]
