"""`labkit.launching.launch` / `labkit launch` with plain user scripts: exit codes, logs, live output, errors."""

import json
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import labkit_cli
from labkit.core.errors import ConfigError
from labkit.launching.launch import LaunchError, launch

HELLO = textwrap.dedent("""
    import os, sys, time
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    print(f"hello from rank {rank} of {dist.get_world_size()}", flush=True)
    time.sleep(float(os.environ.get("HELLO_SLEEP", "0")))
    print(f"bye from rank {rank}", flush=True)
    dist.barrier(); dist.destroy_process_group()
    sys.exit(int(os.environ.get("HELLO_EXIT", "0")))
""")

CRASH = textwrap.dedent("""
    import torch.distributed as dist
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def main():
        dist.init_process_group("gloo")
        if dist.get_rank() == 1:
            raise ValueError("stage 1 got a tensor of the wrong shape")
        dist.barrier()

    main()
""")


@pytest.fixture
def script(tmp_path):
    def make(text, name="user_script.py"):
        p = tmp_path / name
        p.write_text(text)
        return p
    return make


@pytest.mark.launches
def test_user_script_runs_keeps_logs_and_prefixes_its_lines(script, runs, capsys):
    """One launch (torch imported by an agent and 2 ranks) checks both what it keeps and what it streams."""
    r = launch(script(HELLO), nproc=2, runs_root=runs, progress=False)
    assert r.ok and r.returncode == 0
    for rank in (0, 1):
        assert f"hello from rank {rank} of 2" in r.log(rank, "stdout")
    cmd = json.loads((r.run_dir / "command.json").read_text())["argv"]
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert json.loads((r.run_dir / "run.json").read_text())["status"] == "ok"
    out = capsys.readouterr().out  # streamed live, each line prefixed by its rank
    assert "[rank0] hello from rank 0" in out and "[rank1] hello from rank 1" in out


@pytest.mark.launches
def test_failing_rank_is_named_with_its_log_tail(script, runs):
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as e:
        launch(script(CRASH), nproc=2, runs_root=runs, progress=False, stream="none")
    msg = str(e.value)
    assert "Rank 1 failed" in msg and "wrong shape" in msg
    assert "Command:" in msg and "torch.distributed.run" in msg
    assert e.value.run.failed_rank == 1 and e.value.run.status == "failed"
    assert time.monotonic() - t0 < 120  # by the failure, not the 900 s deadline (start-up: 5-30 s on a busy laptop)


TEARDOWN_ABORT = textwrap.dedent("""
    import os, sys
    print("done", flush=True)
    sys.stderr.write("terminate called without an active exception\\n"); sys.stderr.flush()
    os.abort()  # what torch's gloo teardown race looks like from outside: SIGABRT after the last line
""")


@pytest.mark.launches
def test_an_abort_at_interpreter_exit_says_how_to_end_the_script(script, runs):
    with pytest.raises(LaunchError) as e:
        launch(script(TEARDOWN_ABORT), nproc=1, runs_root=runs, progress=False, stream="none")
    msg = str(e.value)
    assert "Rank 0 failed" in msg and "exit_now(0)" in msg and "destroy_process_group" in msg, msg


@pytest.mark.launches
def test_cli_launch_streams_while_the_job_runs_and_returns_its_exit_code(script, runs):
    """`labkit launch`: the first rank line reaches us seconds before the job ends (not only at the
    end), and the command exits with the job's own exit code (7). One launch for both."""
    out = runs / "exit7"
    proc = subprocess.Popen(labkit_cli("launch", "--nproc", "2", "--out", str(out), "--quiet", str(script(HELLO))),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**__import__("os").environ, "HELLO_SLEEP": "4", "HELLO_EXIT": "7"})
    first = None
    for line in proc.stdout:
        if "hello from rank" in line and first is None:
            first = time.monotonic()
    proc.wait(timeout=120)
    end = time.monotonic()
    assert proc.returncode == 7, proc.stderr.read()[-2000:]
    assert first is not None and end - first > 3.0, f"first output only {end - first:.1f}s before the end"
    assert "hello from rank 0" in (next(out.glob("logs/*/attempt_0/0/stdout.log"))).read_text()


def test_missing_script_is_rejected_before_launch(runs):
    with pytest.raises(ConfigError, match="does not exist"):
        launch(runs / "nope.py", nproc=2, runs_root=runs)
    assert list(runs.iterdir()) == []


@pytest.mark.launches
def test_each_launch_gets_its_own_directory_and_none_is_overwritten(script, runs):
    a = launch(script(HELLO), nproc=1, runs_root=runs, progress=False, stream="none")
    b = launch(script(HELLO), nproc=1, runs_root=runs, progress=False, stream="none")
    assert a.run_dir != b.run_dir and a.run_dir.parent == b.run_dir.parent == runs
    with pytest.raises(ConfigError, match="never overwritten"):  # refused before anything starts
        launch(script(HELLO), nproc=1, out=a.run_dir, progress=False, stream="none")


@pytest.mark.launches
def test_stop_event_ends_the_job_from_another_thread(script, runs):
    import threading

    stop = threading.Event()
    lines, asked = [], []

    def echo(line):  # a Stop button pressed once the ranks run (however long a busy machine takes to start them)
        lines.append(line)
        if "hello from rank" in line and not asked:
            asked.append(time.monotonic())
            threading.Timer(1.0, stop.set).start()

    r = launch(script(HELLO), nproc=2, runs_root=runs, progress=False, stop_event=stop, echo=echo,
               env={"HELLO_SLEEP": "60"}, timeout=300)
    ended = time.monotonic()
    assert asked and any("hello from rank" in l for l in lines)
    # ended by the stop (1 s after the first hello), long before the ranks' 60 s sleep or the deadline
    assert r.status == "interrupted" and ended - asked[0] < 20, ended - asked[0]


@pytest.mark.parametrize("failed_rank, codes, result, mismatch", [
    (0, {0: 3, 1: 3}, {"reference_match": False}, True),   # rank 0 seen first
    (1, {0: 3, 1: 3}, {"reference_match": False}, True),   # rank 1 seen first (a busy machine): still the check
    (1, {1: 3}, {"reference_match": False}, True),         # rank 0 not reported at all: only rank 1 failed, with 3
    (1, {0: 3, 1: 1}, {"reference_match": False}, False),  # rank 1 crashed (exit 1): that is the story
    (0, {0: 3}, {"reference_match": True}, False),         # the step matched: something else failed
    (0, {0: 3}, None, False),                              # no result.json: not a check
])
def test_a_reference_mismatch_is_named_whichever_rank_torchrun_saw_first(tmp_path, failed_rank, codes, result,
                                                                       mismatch):
    from labkit.launching.launch import reference_mismatch
    from labkit.launching.rundir import Run

    r = Run(tmp_path, [], 2, status="failed", result=result, failed_rank=failed_rank, rank_exitcodes=codes)
    assert reference_mismatch(r) is mismatch


def test_a_sweep_shares_one_job_per_world_size_and_device():
    """sweep() runs consecutive RunConfigs of one world size and device in one job (one start-up for all)."""
    from labkit.config.run import RunConfig
    from labkit.launching.sweep import _groups

    a, b = (RunConfig(schedule="GPipe", preset="tiny", n_microbatches=m) for m in (2, 4))
    four = RunConfig(schedule="1F1B", pp_size=4, preset="tiny", n_microbatches=4)
    groups = _groups([a, b, four, a, "other"])
    assert [len(g) for g in groups] == [2, 1, 1, 1] and groups[0] == [a, b] and groups[3] == ["other"]


DEVICE_FORMS = textwrap.dedent("""
    import sys
    import torch, torch.nn as nn
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    form = sys.argv[1]
    device = {"str": "cpu", "device": torch.device("cpu")}[form]
    torch.manual_seed(rank)
    stage = PipelineStage(nn.Linear(4, 4), rank, world, device)  # a string device: torch takes it
    sched = Schedule1F1B(stage, 2, loss_fn=lambda o, t: ((o - t) ** 2).mean())
    x = torch.randn(4, 4)
    sched.step(x) if rank == 0 else sched.step(target=torch.randn(4, 4), losses=[])
    print("stepped", form, flush=True)
    dist.barrier(); dist.destroy_process_group()
""")


@pytest.mark.launches
def test_a_plain_script_with_a_string_device_runs_unchanged_and_is_timed(script, runs):
    """PipelineStage(module, rank, world, "cpu"): torch accepts a string (or an int, cuda:N) for the
    device; the kit's spans recorder must too (it ended every rank with "'str' object has no attribute
    'type'")."""
    for form in ("str", "device"):
        r = launch(script(DEVICE_FORMS), [form], nproc=2, runs_root=runs, progress=False, stream="none")
        assert r.ok, r.log(0)
        assert f"stepped {form}" in r.log(0, "stdout")
        tl = r.timeline("spans")
        computed = sorted({(a.stage, a.kind) for a in tl.actions if a.kind in "FB"})
        assert computed == [(0, "B"), (0, "F"), (1, "B"), (1, "F")]


@pytest.mark.parametrize("form, kind", [("cpu", "cpu"), ("cuda:1", "cuda"), (1, "cuda"), ("cuda", "cuda")])
def test_the_spans_recorder_reads_every_device_form_torch_takes(form, kind):
    """What the recorder does with a stage's device (GPU forms read, not run: no GPU here)."""
    import torch

    from labkit.spans.record import _compute_wrapper
    from labkit.spans.recorder import Recorder
    import labkit.spans.record as record

    class Stage:
        device, stage_index, has_backward = form, 0, True

    rec, old = Recorder(None, 0), record.RECORDER
    rec.pipeline, rec.now = [0], lambda: 0.0  # no process group, no CUDA clock: only the device is read
    record.RECORDER = rec
    try:
        _compute_wrapper(lambda self, chunk_id: None, lambda a, k: "F")(Stage(), 0)
    finally:
        record.RECORDER = old
    assert isinstance(rec.device, torch.device) and rec.device.type == kind
    assert rec._on_cuda() == (kind == "cuda")
