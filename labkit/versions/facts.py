"""The release facts: what each supported torch release (2.11 to 2.15) does where a lesson or a test
asserts it, one row per fact, measured on every release (each row's `measured` says how). Part of
`labkit.versions`, which reads it (`fact`, `has`, `FEATURES`); kept apart only for the size of that module."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fact:
    """What one thing does on each supported torch release, measured on each (not inferred from the
    ends): one row of `RELEASE_FACTS`."""

    name: str
    """The row's key, what cells and tests pass to `fact()` / `has()`."""
    measured: str
    """What was measured, how, and which cells or tests assert it."""
    outcomes: dict
    """{(major, minor): outcome} for every release of `MINORS`, as measured there."""
    feature: str | None = None
    """For an API that one release added (outcomes False, then True): what it is. `FEATURES` lists these."""


RELEASE_FACTS = {f.name: f for f in (
    # ---- API added in a release (the features: has(name)). Measured by looking the name up on each
    # release (tests/test_versions.py looks each up again on the installed torch).
    Fact("pre-split microbatches",
         "'arg_mbs' in inspect.signature(ScheduleGPipe.step).parameters. Notebook 03 (step() with lists).",
         {(2, 11): False, (2, 12): False, (2, 13): False, (2, 14): True, (2, 15): True},
         "schedule.step(arg_mbs=..., kwarg_mbs=..., target_mbs=...)"),
    Fact("loss kwargs",
         "'loss_kwargs' in inspect.signature(Schedule1F1B.step).parameters. Notebook 14, section 1 (the "
         "token-normalised loss by loss_kwargs).",
         {(2, 11): False, (2, 12): False, (2, 13): True, (2, 14): True, (2, 15): True},
         "schedule.step(..., loss_kwargs={...}): keyword arguments for the loss of every microbatch"),
    Fact("activation liveness",
         "hasattr(torch.distributed.pipelining, 'analyze_pipeline_activation_liveness'). Notebooks 04 and 13, "
         "tests/test_notebook_helpers.py.",
         {(2, 11): False, (2, 12): False, (2, 13): False, (2, 14): False, (2, 15): True},
         "torch.distributed.pipelining.analyze_pipeline_activation_liveness"),
    Fact("WAIT actions",
         "hasattr(schedules._ComputationType, 'WAIT_SEND_F'); with them came the stage's start_gradient_reduction "
         "and wait_for_gradient_reduction (REDUCE_GRAD, WAIT_REDUCE_GRAD). Notebooks 06 and 08, "
         "tests/test_torch_internals.py.",
         {(2, 11): False, (2, 12): False, (2, 13): False, (2, 14): False, (2, 15): True},
         "the runtime's WAIT_SEND_F, WAIT_SEND_B and WAIT_REDUCE_GRAD actions"),
    Fact("deferred FSDP gradients",
         "'finalize_gradients' in inspect.signature(ScheduleGPipe.step).parameters. Notebook 12.",
         {(2, 11): False, (2, 12): False, (2, 13): False, (2, 14): False, (2, 15): True},
         "schedule.step(..., finalize_gradients=False): FSDP stages keep their gradients unreduced and "
         "parameters gathered until a step with True"),

    # ---- behaviour: what runs, what fails, what a log prints
    Fact("self warm-up sends",
         "Which stages post a warm-up send to their own rank before the first step, so that gloo dies with "
         "'Pair is not connected' (the module docstring). Measured: world size 1, gloo, a 2-layer MLP as two "
         "stages on the one rank, ScheduleInterleaved1F1B, one step without the kit's workaround, once with "
         "PipelineStage ('manual') and once with pipeline()'s build_stage ('traced'). `apply_workarounds` "
         "patches where this is not empty; tests/test_versions.py, tests/test_models.py.",
         {(2, 11): ("manual", "traced"), (2, 12): ("traced",), (2, 13): ("traced",), (2, 14): ("traced",),
          (2, 15): ()}),
    Fact("skip connection error",
         "The class of the error training a traced skip connection raises (notebook 02, section 'Skip "
         "connections': 4 traced stages on 2 ranks, ScheduleInterleaved1F1B, 'Backward of skip connections "
         "not supported yet'), measured by running that cell on each release.",
         {(2, 11): "AssertionError", (2, 12): "PipeliningMetadataError", (2, 13): "PipeliningMetadataError",
          (2, 14): "PipeliningMetadataError", (2, 15): "PipeliningMetadataError"}),
    Fact("input_args deprecation warning",
         "Whether each rank logs a WARNING that passing `input_args` is deprecated: notebook 06, section 1, "
         "TORCH_LOGS=pp and +pp on the controlled 1F1B job of 2 ranks (WARNING records counted by the log "
         "parser: 2 where True, 0 where False), measured by running the notebook on each release.",
         {(2, 11): True, (2, 12): False, (2, 13): False, (2, 14): False, (2, 15): False}),
    Fact("shape error class",
         "The error torch's stage raises for a microbatch of another shape than the stage was built for "
         "(torch.distributed.pipelining._utils defines only this one of PipeliningShapeError and "
         "PipeliningMetadataError). Notebook 09, section 1; notebook 14, section 9.",
         {(2, 11): "PipeliningShapeError", (2, 12): "PipeliningMetadataError", (2, 13): "PipeliningMetadataError",
          (2, 14): "PipeliningMetadataError", (2, 15): "PipeliningMetadataError"}),
    Fact("shape check needs DETAIL",
         "Whether the stage checks each microbatch's shapes only under TORCH_DISTRIBUTED_DEBUG=DETAIL (torch "
         "2.11 checks every microbatch): 'dist.get_debug_level() == dist.DebugLevel.DETAIL' in stage.py. "
         "Notebook 09, section 1; notebook 14, section 9.",
         {(2, 11): False, (2, 12): True, (2, 13): True, (2, 14): True, (2, 15): True}),
    Fact("uneven batch goes through",
         "Notebook 09, section 1: a batch of 10 rows in 4 microbatches ([3, 3, 2, 2] rows) on 2 ranks without "
         "DETAIL: step 1 goes through and the last stage returns 12 rows (True), or torch's always-on check "
         "refuses it (False). Measured by running the notebook on each release.",
         {(2, 11): False, (2, 12): True, (2, 13): True, (2, 14): True, (2, 15): True}),
    Fact("non-contiguous gradient fails on gloo",
         "Notebook 09, section 1: decoder layers with batch_first=True, dynamic shape inference, gloo: the "
         "backward fails on rank 0 with 'input tensor has to be contiguous' (True), or runs (False: the "
         "receive buffers are allocated contiguous). Measured by running the notebook on each release.",
         {(2, 11): False, (2, 12): True, (2, 13): True, (2, 14): True, (2, 15): True}),
    Fact("warm-up wait",
         "Notebook 09, 'a hang' exercise: the innermost frame of rank 0's stack while it waits for a rank that "
         "never starts its first step (the function it blocks in before the first microbatch). Measured by "
         "running the notebook on each release.",
         {(2, 11): "_wait_batch_p2p", (2, 12): "send", (2, 13): "send", (2, 14): "send", (2, 15): "all_reduce"}),
    Fact("naive Llama trace with transformers 5.23",
         "Notebook 11, section 6 (the tracer on a Llama): pipeline() of the small Llama (use_cache=False, "
         "eager attention, cut at model.layers.2) with transformers 5.23, then its stages on one microbatch: "
         "where it fails ('pipeline()', or 'stage 0' when pipeline() returns a Pipe whose first stage cannot "
         "run). Measured by running the notebook on each release with transformers 5.23 (2.15 too, whose "
         "lock has 5.24: there the cell takes the 5.24 line).",
         {(2, 11): "pipeline()", (2, 12): "pipeline()", (2, 13): "stage 0", (2, 14): "stage 0", (2, 15): "stage 0"}),
    Fact("ZBVZeroBubble compiled in place",
         "Notebook 14, section 4: ScheduleZBVZeroBubble on 4 MLP stages compiled in place (module.compile, "
         "aot_eager), 2 ranks, one checked step; {donated_buffer setting: outcome}, None for torch's default "
         "(True), False with torch._functorch.config.donated_buffer off. 'runs' (and matches the unsplit "
         "model), 'fails: donated buffers' (the first I: a backward compiled with donated buffers refuses "
         "retain_graph), 'fails' (another error: the split backward's autograd function has an invalid "
         "'_input_metadata'). Measured by running the notebook on each release.",
         {(2, 11): {None: "fails", False: "fails"}, (2, 12): {None: "fails", False: "fails"},
          (2, 13): {None: "runs", False: "runs"}, (2, 14): {None: "runs", False: "runs"},
          (2, 15): {None: "fails: donated buffers", False: "runs"}}),
    Fact("compiled module recompiles after its first step",
         "Notebook 14, section 6: each rank's stage module (a user's residual Linear-GELU-Linear block) compiled "
         "in place with aot_eager, Schedule1F1B at 8 microbatches, 3 steps on live ranks: whether dynamo "
         "compiles it once more after its first step (True: 2 graphs and 1 recompile a rank) or once only "
         "(False). torch's own guard, the same under plain torchrun (tests/test_observer.py holds the kit's "
         "counts against plain torchrun's on every leg). Measured by running the notebook on each release.",
         {(2, 11): True, (2, 12): False, (2, 13): False, (2, 14): False, (2, 15): False}),
    Fact("compiled stage falls back in its first warm round",
         "Notebook 14, section 5: Schedule1F1B on its MLP (2 stages, 4 microbatches), the stage wrapped by "
         "torch.compile (inductor), checked once, then 3 rounds of 8 warm steps: whether dynamo recompiles "
         "during the first warm round until its recompile limit and runs the stage eagerly from then on "
         "(True), or compiles nothing after the first step (False); that stage only, not every model or "
         "microbatch count. Measured by running the notebook on each release, again after issue 63 (the kit "
         "no longer hooks the stage's module, nor its activation tracker its forward): the MLP's blocks count "
         "their calls in a Python Counter, a side effect dynamo guards on until its limit on 2.11 to 2.14.",
         {(2, 11): True, (2, 12): True, (2, 13): True, (2, 14): True, (2, 15): False}),
    Fact("eval() breaks the next step",
         "Notebook 14, section 8: schedule.eval(x) on fresh stages, then schedule.step() on the same stages "
         "(2 ranks; 1F1B with 2 stages, the others with 4): the schedules whose step then fails. Measured by "
         "running the notebook on each release.",
         {(2, 11): ("Schedule1F1B", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble"),
          (2, 12): ("ScheduleZBVZeroBubble",), (2, 13): ("ScheduleZBVZeroBubble",),
          (2, 14): ("ScheduleZBVZeroBubble",), (2, 15): ("ScheduleZBVZeroBubble",)}),
)}
"""Every fact a lesson or a test asserts about a torch release, with its outcome on each supported
release, as measured there (each row's `measured` says how). Cells and tests read it with `fact()`."""
