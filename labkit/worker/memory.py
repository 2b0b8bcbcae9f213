"""What a stage holds in memory: its parameters, block by block, and the activations a microbatch leaves.

`param_groups` counts parameter elements per model block (which blocks a stage got from a manual
split or the tracer, notebooks 01 and 02); `saved_activation_bytes` measures what autograd keeps
for one microbatch until its backward (why 1F1B holds fewer microbatches than GPipe, notebook 04).
"""

from __future__ import annotations

from ..core.actions import union_length  # bytes covered by (first, end) ranges


def param_groups(module) -> dict[str, int]:
    """Parameter elements of `module` per owning block, in model order: `{"tok_embeddings": 2048, "layers.0": ...}`.

    A block is the first component of a parameter's name, plus the index when that component is a
    numbered container (`layers.0`); the names are those of the unsplit model, which a manual split
    and the tracer both keep (notebooks 01 and 02).
    """
    out: dict[str, int] = {}
    for name, p in module.named_parameters():
        parts = name.split(".")
        key = ".".join(parts[:2]) if len(parts) > 2 and parts[1].isdigit() else parts[0]
        out[key] = out.get(key, 0) + p.numel()
    return out


def byte_range(t) -> tuple[int, int, int]:
    """(storage, first byte, end byte) of the memory a tensor looks at. A view covers only its own
    part of its storage: the microbatches step() cuts from a batch are views of it, and q, k, v can be
    three views of one projection. Overlapping views (a tensor and its transpose) cover the same bytes."""
    size = t.element_size()
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 0) if t.numel() else 0
    first = t.storage_offset() * size
    return t.untyped_storage().data_ptr(), first, first + span * size


def param_storages(module) -> set[int]:
    """The storages of a module's parameters: what saved-tensor counting leaves out (not activations)."""
    return {(p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr() for p in module.parameters()}


def saved_activation_bytes(module, *inputs) -> int:
    """Bytes autograd saves for the backward during one forward of `module` on `inputs`.

    That is the activation memory one microbatch holds on a stage until its backward runs.
    Storages are counted once, and the module's own parameters (saved by e.g. Linear) are left
    out: they are there whatever the schedule does. Notebook 04.
    """
    import torch

    params = param_storages(module)
    seen: dict[int, set] = {}

    def pack(t):
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in params:
            storage, first, end = byte_range(t)
            seen.setdefault(storage, set()).add((first, end))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(*inputs)
    return sum(union_length(ranges) for ranges in seen.values())


def torch_liveness(schedule, pp_size: int, n_microbatches: int, stages_per_rank: int = 1) -> dict[int, int]:
    """Per rank, the activation slots torch 2.15's `analyze_pipeline_activation_liveness` says the
    schedule's plan needs: the most (stage, microbatch) activations a rank holds at once (granularity
    "stage_microbatch"). Compare with `orders.rank_peak_in_flight` of the kit's plan (notebook 04).

    `schedule` is a schedule's name, or an explicit order `{rank: [(kind, stage, microbatch), ...]}`
    (one stage per rank, e.g. a searched one, notebook 13): torch's action runtime loads it as the
    compute-only CSV a run would (`labkit.versions.runtime_with_order`) and torch analyses what it
    loaded.

    Raises `ScheduleError` on a torch without the analysis (before 2.15), and passes on torch's own
    `ValueError` when it cannot read the schedule's plan (2.15 reads Schedule1F1B's last rank as
    forwarding microbatches 1..m instead of 0..m-1, notebook 04).
    """
    from ..schedules.orders import ScheduleError
    from ..theory.plans import mock_schedule
    from ..versions import has

    if not has("activation liveness"):
        raise ScheduleError("analyze_pipeline_activation_liveness needs torch 2.15 or newer "
                            "(labkit.versions.has('activation liveness')).")
    from torch.distributed.pipelining import analyze_pipeline_activation_liveness as analyze

    from ..schedules.table import stage_placement, schedule_info

    if isinstance(schedule, str):
        sched = mock_schedule(schedule, pp_size, n_microbatches, stages_per_rank)
        placement = stage_placement(pp_size, stages_per_rank, schedule_info(schedule).v_shaped)
    else:
        if stages_per_rank != 1:
            raise ScheduleError(f"An explicit order is analysed with one stage per rank (stage r on rank r); "
                                f"got stages_per_rank={stages_per_rank}: pass 1.")
        sched = _runtime_with_order(schedule, pp_size, n_microbatches)
        placement = [[r] for r in range(pp_size)]
    return {r: analyze(sched, pp_rank=r, stage_indices=placement[r], granularity="stage_microbatch").num_slots
            for r in range(pp_size)}


def _runtime_with_order(order, pp_size: int, n_microbatches: int):
    """torch's action runtime for rank 0 (a planning stage, no process group) with `order` loaded
    through its CSV, the route a real run takes (`labkit.versions.runtime_with_order`)."""
    import tempfile
    from pathlib import Path

    from ..schedules.orders import order_csv
    from ..versions import planning_stages, runtime_with_order

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "order.csv"
        path.write_text(order_csv(order))
        return runtime_with_order(planning_stages([0], pp_size, pp_size), n_microbatches, path)


class SavedTensorTracker:
    """Measured activation memory: the bytes autograd keeps for the backward, per stage, over a step.

    Saved-tensor hooks (`torch.autograd.graph.saved_tensors_hooks`) go around each stage's forward, from
    outside its module (around the stage's call of it, `labkit.versions.STAGE_MODULE_CALL`; a stand-in
    without that call: around its module's `forward`), so a module compiled in place traces as it does
    without the tracker (inside it, dynamo breaks its graph at the hooks; tests/test_observer.py):
    every tensor autograd saves is wrapped in a small holder, counted when it is saved and uncounted
    when autograd lets it go (after the backward that needs it: B, or W for a split backward). Bytes
    are those the saved tensors look at (`byte_range`: a view counts its part of its storage, memory
    saved twice counts once), and the stage's own parameters are not activations and are left out.
    `events` holds `(time, stage, bytes held by that stage)` at every change, time as
    `time.time()` (the clock of the kit's log lines, so it lines up with the step's timeline). On a
    GPU each event also carries `torch.cuda.memory_allocated()`, the allocator's view (everything,
    not only activations); on CPU that field is None.

        tracker = SavedTensorTracker(stages)      # on each rank, before schedule.step(...)
        schedule.step(...)
        tracker.events                            # the kernel draws them: plot.plot_memory

    One tracker, many steps: it counts PER STEP. torch's `schedule.step()` begins by clearing each
    stage's runtime state (`clear_runtime_states`, torch 2.11 to 2.15); the tracker hooks that call,
    so every step starts from zero: `events` and `peak()` are the latest step's (`steps` counts the
    steps seen), and bytes an earlier step saved that are still held when a step begins are not
    that step's: they are reported in `carried` ({stage: bytes}) and left out of its counts. A
    second tracker on the same stages replaces the first (it would otherwise sit inside the first's
    wrapper and see nothing): the first stops counting. `labkit.ranks.choose` measures each
    candidate schedule this way (notebook 05).

    The holder keeps a detached view of the saved tensor (the same bytes, no autograd history).
    Holding the tensor itself made a cycle for a saved OUTPUT (holder -> tensor -> its grad_fn ->
    the node that saved it -> holder) that no collector can break, since autograd's nodes live in
    C++: when a node is never run with retain_graph off (the input-gradient half of a split backward,
    `I`, runs with retain_graph=True, and `W` does not walk that part of the graph), its saved outputs
    were never released, by the tracker nor by the rank: the zero-bubble schedules' peaks grew within
    a step and from step to step (ZBVZeroBubble, 2 ranks, a small MLP: 33, 50, 66 KB over 3 steps of
    one tracker instead of 20 KB each; issue 42).
    """

    def __init__(self, stages):
        import torch

        self.events: list[tuple[float, int, int, int | None]] = []
        self.steps = 0
        self.carried: dict[int, int] = {}
        self._held: dict[int, int] = {}
        self._live: dict[tuple[int, int], dict[tuple[int, int], int]] = {}  # (stage, storage) -> {range: count}
        self._generation = 0  # holders saved under an earlier generation (step) no longer change the counts
        self._fresh = True    # nothing counted since the last new_step()
        self._torch = torch
        for st in stages:
            self._wrap(st, st.submod, st.stage_index)
            self._hook_step(st)

    def _hook_step(self, stage) -> None:
        """Start a new step whenever torch's step() clears this stage's runtime state (its first act)."""
        original = getattr(stage, "clear_runtime_states", None)
        if original is None:  # not a PipelineStage (a test's stand-in): one step, counted from creation
            return
        original = getattr(original, "_labkit_original", original)  # a previous tracker's hook: replaced
        tracker = self

        def clear_runtime_states(*args, **kwargs):
            tracker.new_step()
            return original(*args, **kwargs)

        clear_runtime_states._labkit_original = original
        stage.clear_runtime_states = clear_runtime_states

    def new_step(self) -> None:
        """Count from zero: what is held now was saved by an earlier step (`carried`). torch's
        `schedule.step()` calls it through each stage; a rank with several stages calls it once per
        stage, back to back, and only the first call (something counted since the last) starts a step."""
        if self.steps and self._fresh:
            return
        self.carried = {s: n for s, n in self._held.items() if n}
        self.events = []
        self._held = {s: 0 for s in self._held}
        self._live = {}
        self._generation += 1
        self.steps += 1
        self._fresh = True

    def _wrap(self, holder, module, stage: int) -> None:
        from ..versions import STAGE_MODULE_CALL

        torch = self._torch
        params = param_storages(module)
        # the stage's call of its module (outside any compiled region), else the module's own forward
        target, name = (holder, STAGE_MODULE_CALL) if callable(getattr(holder, STAGE_MODULE_CALL, None)) else \
            (module, "forward")
        original = getattr(target, name)
        original = getattr(original, "_labkit_original", original)  # a previous tracker's wrapper: replaced
        tracker = self

        def pack(t):
            try:
                if t.untyped_storage().data_ptr() in params or t.numel() == 0:
                    return t  # a weight (or nothing): not an activation
                storage, first, end = byte_range(t)
            except RuntimeError:  # no storage to read (a DTensor's wrapper under tensor parallelism): its
                return t          # local tensor, which holds the bytes, is saved and counted on its own
            return _Held(tracker, stage, t.detach(), storage, (first, end))  # detached: no cycle (see the class)

        def unpack(held):
            return held.tensor if isinstance(held, _Held) else held

        def forward(*args, **kwargs):
            params.update(param_storages(module))  # FSDP2 swaps in gathered parameters before each forward
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                return original(*args, **kwargs)

        forward._labkit_original = original
        setattr(target, name, forward)
        self._held.setdefault(stage, 0)

    def _change(self, stage: int, storage: int, rng: tuple[int, int], delta: int, device, generation: int) -> None:
        import time

        if generation != self._generation:
            return  # saved by an earlier step: counted there (and in `carried`), not in this one

        live = self._live.setdefault((stage, storage), {})
        before = union_length(live)
        live[rng] = live.get(rng, 0) + delta
        if live[rng] <= 0:
            del live[rng]
        change = union_length(live) - before
        if not live:
            del self._live[(stage, storage)]
        if change == 0:
            return
        self._held[stage] += change
        self._fresh = False
        allocated = self._torch.cuda.memory_allocated(device) if getattr(device, "type", "cpu") == "cuda" else None
        self.events.append((time.time(), stage, self._held[stage], allocated))

    def peak(self) -> dict[int, int]:
        """Per stage, the most bytes held at once."""
        out = {s: 0 for s in self._held}
        for _, s, held, _ in self.events:
            out[s] = max(out[s], held)
        return out

    def rank_peak(self) -> int:
        """The most bytes this rank's stages held AT ONCE (`rank_peak` of the events)."""
        return rank_peak(self.events)


def rank_peak(events) -> int:
    """The most bytes a rank's stages held AT ONCE, from a tracker's events (time, stage, bytes, ...):
    the sum of the stages' own peaks would overstate a rank with two stages (V-shaped or looped: they
    peak at different times)."""
    held: dict[int, int] = {}
    best = 0
    for _, stage, n, *_ in events:
        held[stage] = n
        best = max(best, sum(held.values()))
    return best


class _Held:
    """A saved tensor, as autograd's graph holds it: counted while the graph keeps this holder."""

    __slots__ = ("tensor", "tracker", "stage", "storage", "rng", "device", "generation")

    def __init__(self, tracker, stage, tensor, storage, rng):
        self.tensor, self.tracker, self.stage, self.storage, self.rng = tensor, tracker, stage, storage, rng
        self.device, self.generation = tensor.device, tracker._generation
        tracker._change(stage, storage, rng, +1, self.device, self.generation)

    def __del__(self):
        try:
            self.tracker._change(self.stage, self.storage, self.rng, -1, self.device, self.generation)
        except Exception:  # interpreter shutdown: nothing left to count
            pass
