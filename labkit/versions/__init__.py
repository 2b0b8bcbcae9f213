"""The torch releases the kit supports, what each one differs in, and every use of torch's private API:
the one place to read (and to adapt) when torch changes. Supported and tested: torch 2.11 to 2.15.

- Ranges: `RANGES` declares the range of every dependency in pyproject.toml: its floor
  (pyproject.toml's and environment.yml's `>=`, None where they give none) and the newest release
  tested (the main lock's). `dev.py test` covers both ends: its first leg runs the whole suite on the
  main lock (requirements/lab-torch2.15.txt: the newest of everything), its second leg the reference
  runs, the log parser and every notebook on the floors lock (requirements/lab-torch2.11.txt: torch
  2.11 and every package that has a floor at that floor, e.g. transformers 5.23).
  tests/test_environment.py keeps these ranges, pyproject.toml and the two locks in step; `labkit
  doctor` checks the installed packages against them (`range_problem`).
- Release facts: what a lesson or a test asserts about a torch release (what fails, what runs, what a
  log prints, which API exists) is a row of `RELEASE_FACTS` (versions/facts.py), measured on each of
  2.11 to 2.15; cells and tests assert `fact(name)`, never the version itself. Rows that are an API
  one release added are the features (`FEATURES`, `has(...)`). A lesson that depends on another
  package's release asks for its version itself (notebook 11: transformers 5.23 and 5.24). `dev.py
  test` runs what asks the table on both ends and on a middle release (leg 3, docs/tests.md).
- torch's private API: each use is a named function below (`stage_base_class`, `schedule_classes`,
  `wrap_p2p`, `schedule_state`, `runtime_with_order`, `planning_stages`, ...) whose docstring says which
  releases it covers; no other module of the kit imports a private torch name (test_torch_internals).

The work-around ('Pair is not connected'): torch 2.11 posts one warm-up send and receive between neighbouring
stages before a multi-stage schedule's first step, also when both live on one rank (the V placement of
ZBVZeroBubble and DualPipeV, `--nproc 1`); gloo has no connection from a rank to itself. The patch drops the
warm-ups a rank would send to itself (a dummy scalar; the runtime moves tensors between two stages of one rank
without sending them). 2.12 fixed it for `PipelineStage`, 2.12 to 2.14 keep it for the tracer's stages, 2.15
removed it (`RELEASE_FACTS["self warm-up sends"]`). `worker.init_distributed` and the kit's stage builders
(`worker.stages.build_stages`, the transformers adapter) apply it, for manual and traced stages alike.

May import: nothing of labkit.
"""

from __future__ import annotations

import functools
import re
from .facts import RELEASE_FACTS, Fact  # noqa: F401  (the table of what each release does: versions/facts.py)
from .ranges import RANGES, Range  # noqa: F401  (every dependency's supported range: versions/ranges.py)

SUPPORTED = tuple(tuple(int(x) for x in v.split(".")) for v in (RANGES["torch"].floor, RANGES["torch"].newest))
"""The oldest and newest (major, minor) torch the kit is tested on (RANGES["torch"])."""

MINORS = tuple((SUPPORTED[0][0], m) for m in range(SUPPORTED[0][1], SUPPORTED[1][1] + 1))
"""Every supported minor release, oldest first: (2, 11), (2, 12), (2, 13), (2, 14), (2, 15)."""

FEATURES = {f.name: (next(v for v in MINORS if f.outcomes[v]), f.feature) for f in RELEASE_FACTS.values() if f.feature}
"""What a torch version added that a lesson shows: name -> (first version, what it is); RELEASE_FACTS' rows."""

SELF_P2P_FIXED = next(v for v in MINORS if not RELEASE_FACTS["self warm-up sends"].outcomes[v])
"""From this torch on, no stage posts a warm-up send to its own rank (see the module docstring)."""

RUNTIME = "torch.distributed.pipelining.schedules._PipelineScheduleRuntime"
"""The full name of torch's action runtime (private in torch 2.11 to 2.15), as a result records it."""


def parse(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as '2.15.0+cu132'."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def installed() -> tuple[int, int]:
    """(major, minor) of the installed torch (any release: torch 2.11 to 2.15 give (2, 11) to (2, 15))."""
    import torch

    return parse(torch.__version__)


def text(v: tuple[int, int]) -> str:
    return f"{v[0]}.{v[1]}"


def fact(name: str, version=None):
    """The outcome of the fact `name` (a key of RELEASE_FACTS) on `version` ('2.13.0+cpu', (2, 13); None: the
    installed torch), as measured on torch 2.11 to 2.15. A release newer than the newest tested gets the
    newest's outcome (`labkit doctor` warns that it is untested); an older one is refused."""
    if name not in RELEASE_FACTS:
        raise KeyError(f"Unknown release fact {name!r}; labkit.versions.RELEASE_FACTS has {', '.join(RELEASE_FACTS)}.")
    v = installed() if version is None else parse(version) if isinstance(version, str) else tuple(version[:2])
    if v < MINORS[0]:
        raise ValueError(f"torch {text(v)} is older than {text(MINORS[0])}, the oldest the kit supports: "
                         f"pip install 'torch>={text(MINORS[0])}'")
    return RELEASE_FACTS[name].outcomes[min(v, MINORS[-1])]


def has(feature: str) -> bool:
    """Whether the installed torch has `feature` (a key of FEATURES: an API that torch 2.13, 2.14 or 2.15
    added to torch 2.11's pipelining; a row of RELEASE_FACTS)."""
    if feature not in FEATURES:
        raise KeyError(f"Unknown feature {feature!r}; the kit knows {', '.join(FEATURES)}.")
    return bool(fact(feature))


def release(version: str) -> tuple[int, ...]:
    """The numbers of a release: '2.15.0+cu132' -> (2, 15, 0), '5.24.0rc1' -> (5, 24, 0)."""
    return tuple(int(re.match(r"\d+", part).group()) for part in version.split("+")[0].split(".")
                 if re.match(r"\d+", part))


def range_problem(name: str, version: str) -> tuple[str, str] | None:
    """None for a release of `name` (a key of RANGES) inside its range, else ("older", message) (below
    the floor: a problem, with the pip command that fixes it) or ("newer", message) (past the newest
    tested: a warning, it may work)."""
    r = RANGES[name]
    have = release(version)
    tested = f"{r.floor} to {r.newest}" if r.floor else f"up to {r.newest}"
    if r.floor and have[:len(release(r.floor))] < release(r.floor):
        return "older", (f"{name} {version} is older than {r.floor}, the oldest the kit supports: "
                         f"pip install '{name}>={r.floor}' (the kit is tested on {tested})")
    if have[:len(release(r.newest))] > release(r.newest):
        return "newer", (f"{name} {version} is newer than {r.newest}, the newest the kit was tested on: it may "
                         f"work; if a notebook disagrees, pip install '{name}=={r.newest}.*'")
    return None


def support_problem(version: str) -> str | None:
    """None for a torch in the supported range, else what is wrong and how to fix it."""
    found = range_problem("torch", version)
    return found[1] if found else None


def drop_self_p2p(ops: list, group_rank: int) -> list:
    """The warm-up ops (`dist.P2POp`) without those whose peer is this rank itself (ranks in the
    pipeline's group, as `op.group_peer` and the stage's `group_rank` are; torch 2.11 to 2.14)."""
    return [op for op in ops if op.group_peer != group_rank]


@functools.cache
def apply_workarounds() -> list[str]:
    """Patch the installed torch where the kit needs it (see the module docstring); the names of the
    patches applied. Covers torch 2.11 to 2.14 (`_PipelineStageBase._get_init_p2p_neighbors_ops`,
    private); does nothing on torch 2.15 and later. Idempotent and cheap: call it wherever stages are
    built."""
    if not fact("self warm-up sends"):
        return []
    base = stage_base_class()
    original = getattr(base, "_get_init_p2p_neighbors_ops", None)
    if original is None:
        return []

    @functools.wraps(original)
    def without_self(self):
        return drop_self_p2p(original(self), self.group_rank)

    base._get_init_p2p_neighbors_ops = without_self
    return ["no warm-up send of a rank to itself (stages sharing a rank on gloo: every stage with torch 2.11, "
            "traced stages with 2.12 to 2.14)"]


# ---- torch's private API: every use of it in the kit goes through one of these ----

def stage_base_class() -> type:
    """torch's `_PipelineStageBase` (torch.distributed.pipelining.stage, private in torch 2.11 to 2.15):
    the class every stage (`PipelineStage`, the tracer's `_PipelineStage`) inherits its per-chunk
    compute from (`forward_one_chunk`, ...); `labkit.spans.record` wraps those methods on it."""
    from torch.distributed.pipelining.stage import _PipelineStageBase

    return _PipelineStageBase


STAGE_MODULE_CALL = "forward_maybe_with_nosync"
"""The method of `stage_base_class()` through which a stage calls its module on a microbatch
(`self.submod(*args, **kwargs)`, in `forward_one_chunk`; private, torch 2.11 to 2.15): the spans
recorder wraps it to fingerprint what the module received and returned (labkit.spans.received) from
outside the module, where no compiled region reaches."""


def stage_module_call() -> str | None:
    """`STAGE_MODULE_CALL` where this torch's stages have it (torch 2.11 to 2.15), else None (the inputs
    are then not recorded)."""
    return STAGE_MODULE_CALL if STAGE_MODULE_CALL in vars(stage_base_class()) else None


def stage_reduce_grad_methods() -> tuple[str, ...]:
    """The names of the stage methods that reduce FSDP gradients, where this torch defines them on
    `stage_base_class()`: `perform_reduce_grad` (torch 2.11 to 2.15), `start_gradient_reduction` and
    `wait_for_gradient_reduction` (torch 2.15: the runtime's REDUCE_GRAD / WAIT_REDUCE_GRAD)."""
    base = stage_base_class()
    return tuple(n for n in ("perform_reduce_grad", "start_gradient_reduction", "wait_for_gradient_reduction")
                 if n in vars(base))


def schedule_classes() -> list[type]:
    """Every schedule class of torch.distributed.pipelining.schedules (the subclasses of the private
    `_PipelineSchedule`, itself included; torch 2.11 to 2.15), for wrapping their `step` / `eval`."""
    from torch.distributed.pipelining import schedules

    return [obj for obj in list(vars(schedules).values())
            if isinstance(obj, type) and issubclass(obj, schedules._PipelineSchedule)]


def schedule_class(cls_name: str) -> type | None:
    """`torch.distributed.pipelining.<cls_name>` (e.g. "ScheduleZBVZeroBubble"), None where this torch
    has no such schedule. Every schedule the kit names exists in torch 2.11 to 2.15."""
    import torch.distributed.pipelining as pipelining

    return getattr(pipelining, cls_name, None)


def accepts_kwargs_chunk_spec(schedule_cls: type) -> bool:
    """Whether a schedule class takes `kwargs_chunk_spec`: every schedule but ScheduleLoopedBFS does in
    torch 2.11 to 2.15 (its default cuts every tensor kwarg along dim 0)."""
    import inspect

    return "kwargs_chunk_spec" in inspect.signature(schedule_cls.__init__).parameters


def is_schedule(obj) -> bool:
    """Whether `obj` is a torch schedule object (an instance of the private `_PipelineSchedule`, the
    base of every schedule in torch 2.11 to 2.15); False where torch's pipelining cannot be imported."""
    try:
        from torch.distributed.pipelining.schedules import _PipelineSchedule
    except Exception:
        return False
    return isinstance(obj, _PipelineSchedule)


def schedule_state(schedule) -> tuple[int | None, list]:
    """(n_microbatches, stages) of a torch schedule object, read from its private attributes
    (`_n_microbatches`; `_stages` of a multi-stage schedule, `_stage` of a single-stage one; torch 2.11
    to 2.15). Missing attributes give None and []."""
    stages = getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)]
    return getattr(schedule, "_n_microbatches", None), [s for s in stages if s is not None]


P2P_FUNCTIONS = {"post": "_batch_p2p", "wait": "_wait_batch_p2p"}
"""torch's private functions (torch.distributed.pipelining.schedules, torch 2.11 to 2.15) that post a
batch of sends and receives, and that wait for them."""


def wrap_p2p(which: str, make_wrapper, skip=frozenset()) -> str | None:
    """Replace the function that posts (`which="post"`) or waits for (`"wait"`) a batch of sends and
    receives (`P2P_FUNCTIONS`, torch 2.11 to 2.15) by `make_wrapper(original)`. Returns the name replaced;
    None where this torch has no such function or its name is in `skip` (already wrapped)."""
    from torch.distributed.pipelining import schedules

    name = P2P_FUNCTIONS[which]
    if name in skip or not hasattr(schedules, name):
        return None
    setattr(schedules, name, make_wrapper(getattr(schedules, name)))
    return name


def runtime_with_order(stages: list, n_microbatches: int, order_csv, loss_fn=None, **kwargs):
    """torch's action runtime for `stages` with the compute-only order of the CSV file `order_csv` loaded;
    torch adds the sends and receives. `_PipelineScheduleRuntime` and `_load_csv(path,
    format="compute_only")`, the route torch's own docstring gives, are both private in torch 2.11 to
    2.15. `kwargs` go to the runtime's constructor (e.g. scale_grads=False, kwargs_chunk_spec=...)."""
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    schedule = _PipelineScheduleRuntime(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, **kwargs)
    schedule._load_csv(str(order_csv), format="compute_only")
    return schedule


def planning_stages(stage_indices, pp_size: int, n_stages: int) -> list:
    """Stand-ins for rank 0's `PipelineStage`s (no model, no process group): enough for a schedule's
    constructor to plan (`pipeline_order`) and for torch 2.15 to analyse that plan. The schedules of
    torch 2.11 to 2.15 read only sizes from their stages when planning; these are autospec mocks, as
    torch's own `_schedule_visualizer.get_schedule_ops` builds them."""
    from unittest import mock

    from torch.distributed.pipelining import PipelineStage

    stages = []
    for s in stage_indices:
        stage = mock.create_autospec(PipelineStage, instance=True)
        stage.group_rank, stage.group_size, stage.num_stages, stage.stage_index = 0, pp_size, n_stages, s
        stage.is_first, stage.is_last, stage.submod = s == 0, s == n_stages - 1, None
        stages.append(stage)
    return stages


def redistribute_logger():
    """The logger of torch's DTensor redistribution (the private module torch.distributed.tensor.
    _redistribute, torch 2.11 to 2.15), which warns on every rank when 2-D shards (FSDP over TP) are
    gathered in two steps."""
    import logging

    return logging.getLogger("torch.distributed.tensor._redistribute")


def keep_store_on_loopback(handler, make_store) -> bool:
    """Make torch's dynamic rendezvous `handler` create the workers' TCP store with `make_store(addr,
    port)` instead of its own (its private `_create_tcp_store_server`, torch 2.11 to 2.15). False, and
    nothing changed, where this torch's handler has no such method."""
    if not hasattr(handler, "_create_tcp_store_server"):
        return False
    handler._create_tcp_store_server = make_store
    return True


def has_hooks(model) -> bool:
    """Whether anything beyond a module's class decides what `model` computes: a forward replaced on
    a module instance, a module's forward or backward hook, a parameter's gradient hook, or a global
    module hook (nn.Module's and Tensor's private dicts, torch 2.11 to 2.15). `labkit.worker.shared`
    shares nothing for such a model: what the hooks do is not in its key."""
    from torch.nn.modules import module as nn_module

    names = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    if any(getattr(nn_module, f"_global{n}", None) for n in names):
        return True
    for m in model.modules():
        if "forward" in m.__dict__ or any(getattr(m, n, None) for n in names):
            return True
        if any(getattr(p, n, None) for p in m.parameters(recurse=False)
               for n in ("_backward_hooks", "_post_accumulate_grad_hooks")):
            return True
    return False


DYNAMO_LIMIT_HIT = re.compile(r"^(Dynamo recompile limit exceeded|(accumulated_)?(cache_size|recompile)_limit reached)")
"""The first line of dynamo's record of a frame it gave up on at a recompile limit: torch 2.11 to 2.15
(its graph-break registry, gb0039) write "Dynamo recompile limit exceeded"; older releases wrote
"<limit> reached". Read by `dynamo_counters`."""


KIT_GUARD = re.compile(r"_labkit|[/\\]labkit[/\\]")
"""A dynamo guard whose reason names the kit's state (`_labkit...` attributes) or a file of the kit: the
kit, not the user's code, made a frame recompile (none does since the kit records from outside modules)."""


def dynamo_counters() -> dict:
    """dynamo's cumulative counts in this process, for `labkit.spans.compiled` to take deltas of (call
    it only once torch._dynamo is imported). Private, all of it: torch._dynamo.utils.counters
    (`frames`: `total` frames dynamo was asked to convert, `ok` those it compiled; `stats`:
    `unique_graphs`; `unimplemented` / `graph_break`: one entry per reason), utils'
    `graph_break_reasons` (one per graph break: torch 2.15 files a data-dependent branch under
    `unimplemented`, not `graph_break`, so only the list counts every break), convert_frame's
    `FRAME_COMPILE_COUNTER` (compile attempts per frame id: a second one is a recompile) and the
    limits in torch._dynamo.config (`recompile_limit`; older releases named it `cache_size_limit`).
    A frame that reaches its limit is counted in `frames["total"]` but not `ok`, recorded under
    `unimplemented` (`DYNAMO_LIMIT_HIT`, the text naming the limit, "Limit type: ...", and its value,
    "currently set to N"), and from then on runs eagerly whenever none of its compiled versions fits.
    Verified on torch 2.15; each name is looked up with a default, so a release without one reads 0.
    `torch._dynamo.reset()` empties the graph-break list and the per-frame counter, not the counters."""
    from torch._dynamo import config, convert_frame, utils

    counters = utils.counters
    frames, stats = counters.get("frames", {}), counters.get("stats", {})
    reasons = getattr(utils, "graph_break_reasons", None)
    hits: dict[str, int] = {}
    limits: dict[str, int] = {}
    for category in ("unimplemented", "graph_break"):
        for text, n in list(counters.get(category, {}).items()):
            if n <= 0 or not DYNAMO_LIMIT_HIT.match(str(text)):
                continue
            kind = re.search(r"Limit type: (\w+)", text) or re.match(r"(\w+) reached", text)
            name = (kind.group(1) if kind else "recompile_limit").replace("cache_size_limit", "recompile_limit")
            hits[name] = hits.get(name, 0) + int(n)
            value = re.search(r"currently set to (\d+)", text)
            limit = int(value.group(1)) if value else getattr(config, name, None)
            if limit is None:  # the name before torch 2.6
                limit = getattr(config, name.replace("recompile_limit", "cache_size_limit"), None)
            if limit is not None:
                limits[name] = int(limit)
    per_frame = getattr(convert_frame, "FRAME_COMPILE_COUNTER", {})
    # utils.guard_failures: {code: [why each cached version did not fit]}, each reason with the source line
    # of the guard ("... # labkit/spans/received.py:62 in hook"): a guard on the kit's own code or state
    kit = sum(1 for reasons in list(getattr(utils, "guard_failures", {}).values()) for r in list(reasons)
              if KIT_GUARD.search(str(r).split("User stack trace:")[0]))
    return {"frames_total": int(frames.get("total", 0)), "frames_ok": int(frames.get("ok", 0)),
            "graphs": int(stats.get("unique_graphs", 0)),
            "graph_breaks": len(reasons) if reasons is not None else int(sum(counters.get("graph_break", {}).values())),
            "compiles": {k: int(v) for k, v in list(per_frame.items()) if isinstance(k, int)},
            "limit_hits": hits, "limits": limits, "kit_guards": kit}


def compiled_module(module) -> bool:
    """Whether torch.compile wraps `module` or a module inside it, for `labkit.spans.compiled` (is this
    stage's compiled code what runs?): `torch.compile(m)` returns an `OptimizedModule`
    (torch._dynamo.eval_frame), `m.compile()` compiles in place and sets nn.Module's
    `_compiled_call_impl`. Private, both; the same in torch 2.11 to 2.15. False for anything else."""
    from torch._dynamo.eval_frame import OptimizedModule

    return any(isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None
               for m in module.modules())


def float64_norms(tensors: list) -> list:
    """Each tensor's 2-norm accumulated in float64, as `torch.linalg.vector_norm(t, dtype=torch.float64)`
    gives it, in ONE call: `torch._foreach_norm` with `dtype` (private; the same in torch 2.11 to 2.15; bit
    for bit the per-tensor norm on CPU, tests/test_spans.py). Tensors on several devices: one at a time."""
    import torch

    try:
        return list(torch._foreach_norm(tensors, 2, dtype=torch.float64))
    except (RuntimeError, TypeError):
        return [torch.linalg.vector_norm(t, dtype=torch.float64) for t in tensors]


def unchanged_token(t):
    """(storage address, `_version`: bumped by every in-place op; private, the same in torch 2.11 to 2.15):
    equal for one tensor object, it was not written since. None where unreadable (a subclass)."""
    try:
        return (t.data_ptr(), t._version)
    except (RuntimeError, AttributeError, TypeError):
        return None


def clean_exit_is_done() -> None:
    """In a warm launch's agent (labkit.launching.warm): a rank that ends by `os._exit(0)` (the kit's
    `exit_now`, a live rank closed by its kernel) counts as finished. torch's MultiprocessContext (the
    elastic agent's processes for a function entrypoint: torch/distributed/elastic/multiprocessing/
    api.py, 2.11 to 2.15) waits for each process's return value, which such an exit never sends, and
    would wait for ever; torchrun's subprocesses are judged by their exit code alone. Private API,
    the same in torch 2.11 to 2.15 (`_is_done`, `_pc.processes`, `_return_values`)."""
    from torch.distributed.elastic.multiprocessing.api import MultiprocessContext

    if getattr(MultiprocessContext, "_labkit_clean_exit", False):
        return

    def _is_done(self) -> bool:
        for i, p in enumerate(self._pc.processes if self._pc is not None else []):
            if p.exitcode == 0:
                self._return_values.setdefault(i, None)
        return len(self._return_values) == self.nprocs

    MultiprocessContext._is_done = _is_done
    MultiprocessContext._labkit_clean_exit = True
