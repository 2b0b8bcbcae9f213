"""Faults a workshop room produces, done for real: crashes, hangs, interrupts, killed kernels,
concurrent launches, bad input, exposure on the network, and multi-node jobs."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from conftest import REPO, kit_processes, labkit_cli

from labkit.config.presets import PRESETS
from labkit.core.errors import ConfigError
from labkit.launching.launch import LaunchError, launch

HELLO = textwrap.dedent("""
    import os, sys, time
    import torch.distributed as dist
    dist.init_process_group("gloo")
    print(f"rank {dist.get_rank()} of {dist.get_world_size()} started", flush=True)
    time.sleep(float(os.environ.get("HELLO_SLEEP", "0")))
    dist.barrier(); dist.destroy_process_group()
""")

HANG = textwrap.dedent("""
    import time
    import torch.distributed as dist

    def wait_forever():
        time.sleep(3600)

    dist.init_process_group("gloo")
    print(f"started at {time.time():.3f}", flush=True)
    if dist.get_rank() == 1:
        wait_forever()          # alive but stuck
    dist.barrier()              # rank 0 waits here for rank 1
""")

CRASH = textwrap.dedent("""
    import time
    import torch.distributed as dist
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def main():
        dist.init_process_group("gloo")
        if dist.get_rank() == 1:
            time.sleep(1)
            print(f"raising at {time.time():.3f}", flush=True)
            raise RuntimeError("rank 1 lost its activations")
        dist.barrier()

    main()
""")

# A stand-in for a Jupyter kernel running a cell: calls labkit.launching.launch and blocks until the job ends. ipykernel installs Python's default SIGINT handler
# while a cell runs (it ignores SIGINT otherwise); so does this driver, because a shell that starts
# the test suite in the background without job control hands SIGINT down as ignored.
DRIVER = textwrap.dedent("""
    import signal, sys
    import labkit
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        labkit.launch(sys.argv[1], nproc=2, out=sys.argv[2], progress=False, timeout=None)
    except KeyboardInterrupt:
        print("driver saw KeyboardInterrupt", flush=True)
        sys.exit(130)
""")


@pytest.fixture
def write(tmp_path):
    def make(text, name):
        p = tmp_path / name
        p.write_text(text)
        return p
    return make


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            pass
    return out


def _wait_gone(procs, limit):
    t0 = time.monotonic()
    while _alive(procs) and time.monotonic() - t0 < limit:
        time.sleep(0.1)
    return time.monotonic() - t0, _alive(procs)


def _wait_for_ranks(run_dir: Path, n: int, limit: float = 60) -> list[psutil.Process]:
    """Wait until n ranks of the job in run_dir have printed, and return every kit process of it."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        logs = list(run_dir.glob("logs/*/attempt_0/*/stdout.log"))
        if len(logs) >= n and all("started" in p.read_text() for p in logs):
            return kit_processes(run_dir)
        time.sleep(0.2)
    raise AssertionError(f"ranks did not start within {limit}s")


# 1. a rank raises ----------------------------------------------------------------------------

@pytest.mark.launches
def test_crash_is_reported_quickly_with_rank_and_tail(write, runs):
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as e:
        launch(write(CRASH, "crash.py"), nproc=2, runs_root=runs, progress=False, stream="none", timeout=300)
    reported, took = time.time(), time.monotonic() - t0
    run = e.value.run
    assert run.failed_rank == 1 and "lost its activations" in str(e.value)
    assert "Command:" in str(e.value) and "stderr:" in str(e.value)  # the log tail
    record = json.loads((run.run_dir / "run.json").read_text())
    assert record["status"] == "failed" and record["failed_rank"] == 1 and "lost its activations" in record["error"]
    assert run.log(0) is not None and "lost its activations" in run.log(1)
    # Reported by the crash itself, not by a deadline (300 s here; rank 0 would wait in its barrier
    # until then): timed from the moment rank 1 raised, so a slow start-up on a busy machine (torch's
    # import alone takes 5 to 25 s there) does not count. About 1-3 s idle, under 10 s with every core busy.
    raised = float(re.search(r"raising at (\d+\.\d+)", run.log(1, "stdout")).group(1))
    assert run.status == "failed" and reported - raised < 30, (reported - raised, took)
    print(f"crash reported {reported - raised:.1f}s after rank 1 raised ({took:.1f}s with the start-up)")


# 2. a rank hangs -----------------------------------------------------------------------------

# The deadline must leave the ranks time to reach the hang: with every core busy, importing torch
# alone took over 12 s (the stacks then showed import frames, not wait_forever).
HANG_DEADLINE = 40


@pytest.mark.launches
def test_hang_is_ended_at_the_deadline_with_every_stack(write, runs):
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as e:
        launch(write(HANG, "hang.py"), nproc=2, runs_root=runs, progress=False, stream="none", timeout=HANG_DEADLINE)
    took = time.monotonic() - t0
    run, msg = e.value.run, str(e.value)
    assert run.status == "timeout" and f"{HANG_DEADLINE} s deadline" in msg
    assert re.search(r"rank 1: .*hang\.py:\d+ in wait_forever", msg), msg
    assert re.search(r"rank 0: .*hang\.py:\d+ in <module>", msg), msg
    stacks = (run.run_dir / "stacks.txt").read_text()
    assert "=== rank 0 ===" in stacks and "=== rank 1 ===" in stacks
    assert took < HANG_DEADLINE + 15, took
    print(f"hang ended {took - HANG_DEADLINE:.1f}s after the deadline")


STALL = 3


@pytest.mark.launches
def test_a_stall_ends_a_hung_job_soon_after_its_ranks_go_silent(write, runs):
    """stall= counts the silence after every rank has written a line, not the start-up: the job is
    ended STALL s after the ranks' last line (plus a poll), long before its 300 s deadline, with
    every stack, as at a deadline."""
    with pytest.raises(LaunchError) as e:
        launch(write(HANG, "hang.py"), nproc=2, runs_root=runs, progress=False, stream="none", timeout=300,
               stall=STALL)
    reported = time.time()
    run, msg = e.value.run, str(e.value)
    assert run.status == "timeout" and f"No rank wrote anything for {STALL} s (stall=)" in msg, msg
    assert "Raise stall= (--stall)" in msg and "deadline" not in msg.split("Where")[0]
    assert re.search(r"rank 1: .*hang\.py:\d+ in wait_forever", msg), msg
    assert "=== rank 0 ===" in (run.run_dir / "stacks.txt").read_text()
    last = max(float(re.search(r"started at (\d+\.\d+)", run.log(r, "stdout")).group(1)) for r in (0, 1))
    assert STALL <= reported - last < STALL + 20, reported - last
    print(f"stall: ended {reported - last:.1f}s after the ranks' last line")


def test_silence_counts_only_once_every_rank_has_written(tmp_path):
    from labkit.launching.stream import Streamer

    logs = [tmp_path / f"logs/x/attempt_0/{r}/stdout.log" for r in (0, 1)]
    for f in logs:
        f.parent.mkdir(parents=True)
        f.write_text("")
    st = Streamer(tmp_path, 2, "none", None)
    st.poll()
    assert st.silent_for() is None  # nobody has written: the start-up, never silence
    logs[0].write_text("rank 0 ready\n")
    st.poll()
    assert st.silent_for() is None  # rank 1 still starting
    with open(logs[1], "a") as f:
        f.write("progress 1/4\r")  # part of a line counts too (a progress bar)
    st.poll()
    time.sleep(0.2)
    st.poll()
    assert 0.15 < st.silent_for() < 5
    with open(logs[0], "a") as f:
        f.write("step 2\n")
    st.poll()
    assert st.silent_for() < 0.15


def test_stall_must_be_a_positive_number():
    with pytest.raises(ConfigError, match="stall must be a positive number of seconds"):
        launch(__file__, stall=-1)


# 3. interrupt (Jupyter's stop button, nbval's cell timeout) -----------------------------------

def _start_driver(write, tmp_path, script_text, sleep="60"):
    driver = write(DRIVER, "driver.py")
    script = write(script_text, "job.py")
    out = tmp_path / "runs" / "driven"
    env = {**os.environ, "HELLO_SLEEP": sleep, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, str(driver), str(script), str(out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return proc, out


@pytest.mark.launches
def test_sigint_to_the_kernels_process_group_ends_every_rank(write, tmp_path, runs):
    proc, out = _start_driver(write, tmp_path, HELLO)
    job = _wait_for_ranks(out, 2)
    before = len(job)
    os.killpg(proc.pid, signal.SIGINT)  # what Jupyter's interrupt does to the kernel's group
    took, left = _wait_gone(job, 10)
    assert not left, [p.pid for p in left]
    proc.wait(timeout=10)
    assert "driver saw KeyboardInterrupt" in proc.stdout.read()
    record = json.loads((out / "run.json").read_text())
    assert record["status"] == "interrupted"
    assert all(p.exists() for p in out.glob("logs/*/attempt_0/*/stdout.log"))
    print(f"interrupt: {before} kit processes before, 0 after {took:.1f}s")


# 4. the kernel is killed hard ------------------------------------------------------------------

@pytest.mark.launches
def test_ranks_exit_by_themselves_when_the_kernel_is_killed(write, tmp_path, runs):
    proc, out = _start_driver(write, tmp_path, HELLO)
    job = _wait_for_ranks(out, 2)
    before = len(job)
    proc.kill()  # SIGKILL: no Python cleanup runs in the "kernel"
    took, left = _wait_gone(job, 15)
    assert not left, [(p.pid, p.name()) for p in left]
    proc.wait()
    print(f"kernel SIGKILL: {before} kit processes before, 0 after {took:.1f}s")


@pytest.mark.serial  # `labkit clean --all` ends every kit process on the machine, other tests' included
def test_clean_ends_orphans_and_nothing_else(tmp_path, runs):
    """clean() ends a kit process whose owner is gone, and nothing that is not an orphan. Every launch
    and pool start on this machine sweeps orphans too (another session's lab, a suite beside this one),
    so one may end this test's orphan first: it then must be gone already, and the test tries again
    with a new one (at most 5 times); other work's orphans clean() ends as well are orphans too."""
    from labkit.core.processes import OWNER_VAR, RUN_DIR_VAR, owner_token
    from labkit.launching.clean import clean

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_owner = owner_token(gone.pid)
    gone.wait()
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    owned = subprocess.Popen(sleeper, env={**os.environ, RUN_DIR_VAR: str(runs / "y"), OWNER_VAR: owner_token()})
    stranger = subprocess.Popen(sleeper)
    orphans = []
    try:
        for attempt in range(5):
            orphan = subprocess.Popen(sleeper, env={**os.environ, RUN_DIR_VAR: str(runs / f"x{attempt}"),
                                                    OWNER_VAR: dead_owner})
            orphans.append(orphan)
            time.sleep(0.5)
            ended = clean()
            assert all(k.orphan for k in ended), f"clean() ended a process that is no orphan: {ended}"
            assert owned.pid not in [k.pid for k in ended] and stranger.pid not in [k.pid for k in ended]
            if orphan.pid in [k.pid for k in ended]:
                break
            # not found: only because another launch's sweep ended it first
            assert orphan.wait(timeout=5) is not None, f"clean() missed a live orphan: {ended}"
        else:
            pytest.fail("5 orphans in a row were ended by other launches' sweeps before clean() ran")
        assert orphan.wait(timeout=5) is not None
        assert owned.poll() is None and stranger.poll() is None
        p = subprocess.run(labkit_cli("clean", "--all"), capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PYTHONPATH": str(REPO)})
        assert p.returncode == 0 and str(owned.pid) in p.stdout
        assert owned.wait(timeout=5) is not None and stranger.poll() is None
    finally:
        for q in (*orphans, owned, stranger):
            q.kill()
            q.wait()


# 5. concurrency --------------------------------------------------------------------------------

@pytest.mark.launches
def test_eight_launches_at_once(write, runs):
    script = write(HELLO, "hello.py")
    procs = [subprocess.Popen(labkit_cli("launch", "--nproc", "2", "--quiet", "--stream", "none",
                                         "--out", str(runs / f"c{i}"), str(script)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(8)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * 8, "\n".join(o[-1500:] for o in outs)
    for i in range(8):
        logs = sorted((runs / f"c{i}").glob("logs/*/attempt_0/*/stdout.log"))
        assert len(logs) == 2 and all("of 2 started" in p.read_text() for p in logs)


# 6. bad input ------------------------------------------------------------------------------------

BAD_RUNS = [
    (["--schedule", "Bogus"], "Choose one of"),
    (["--schedule", "GPipe", "--stages-per-rank", "2"], "exactly one stage per rank"),
    (["--schedule", "Interleaved1F1B", "--stages-per-rank", "1"], "use GPipe or 1F1B"),
    (["--schedule", "ZBVZeroBubble", "--stages-per-rank", "3"], "exactly --stages-per-rank 2"),
    (["--schedule", "DualPipeV", "--stages-per-rank", "1"], "use GPipe or 1F1B"),
    (["--schedule", "DualPipeV", "--microbatches", "2"], "at least as many microbatches as stages"),
    (["--schedule", "Interleaved1F1B", "--nproc", "2", "--microbatches", "5", "--batch-size", "10"], "multiple of 2"),
    (["--schedule", "GPipe", "--microbatches", "3"], "not divisible"),
    (["--schedule", "GPipe", "--microbatches", "0"], "at least 1"),
    (["--schedule", "GPipe", "--microbatches", "-4"], "at least 1"),
    (["--schedule", "GPipe", "--microbatches", "2.5"], "invalid int value"),
    (["--schedule", "GPipe", "--nproc", "0"], "at least 1"),
    (["--schedule", "GPipe", "--nproc", "two"], "invalid int value"),
    (["--schedule", "GPipe", "--steps", "0"], "at least 1"),
    (["--schedule", "GPipe", "--batch-size", "-8"], "at least 1"),
    (["--schedule", "GPipe", "--nproc", "16"], "every stage needs at least one"),
    (["--schedule", "GPipe", "--device", "cuda", "--nproc", "8"], "needs 8 GPUs"),
    (["--schedule", "GPipe", "--split", "tracer", "--split-points", "layers.99"], "names no module"),
    (["--schedule", "GPipe", "--split-points", "layers.2,layers.5"], "need 1 split points"),
    (["--schedule", "ZBVZeroBubble", "--inference"], "cannot run forward-only"),
    (["--schedule", "GPipe", "--preset", "huge"], "Choose one of: " + ", ".join(PRESETS)),  # every preset named
    (["--schedule", "GPipe", "--timeout", "-1"], "positive number of seconds"),
    (["--schedule", "GPipe", "--stall", "-1"], "stall must be a positive number of seconds"),
    (["--schedule", "GPipe", "--nnodes", "2"], "needs --rdzv-endpoint"),
    (["--schedule", "GPipe", "--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"], "must be below nnodes"),
    (["--schedule", "GPipe", "--nnodes", "2", "--rdzv-endpoint", "nohostport"], "HOST:PORT"),
    (["--schedule", "GPipe", "--pg-timeout", "0"], "positive number"),
]


# the device check imports torch (torch.cuda) in the command's process: a launch's cost, not the quick tier's
BAD_RUNS = [pytest.param(a, f, marks=pytest.mark.launches) if "cuda" in a else (a, f) for a, f in BAD_RUNS]


@pytest.mark.parametrize("args, fix", BAD_RUNS, ids=[" ".join(p.values[0] if hasattr(p, "values") else p[0])
                                                    for p in BAD_RUNS])
def test_bad_run_input_is_rejected_before_torchrun(args, fix, tmp_path):
    out = tmp_path / "never"
    t0 = time.monotonic()
    p = subprocess.run(labkit_cli("run", *args, "--out", str(out)), capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, (p.returncode, p.stdout[-500:], p.stderr[-1500:])
    assert fix in p.stderr, p.stderr
    # Refused before torchrun: no run directory, no process (below); in the time of the CLI's own
    # start-up (seconds; 15-30 s when every core is busy), never a job's.
    assert time.monotonic() - t0 < 45
    assert not out.exists(), "a run directory was created for a rejected run"
    assert kit_processes(tmp_path) == []  # this run's processes only: other tests' jobs run beside it


def test_bad_launch_input(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    script = tmp_path / "ok.py"
    script.write_text("print('hi')\n")
    cases = [
        (["--nproc", "2", str(tmp_path / "missing.py")], "does not exist"),
        (["--nproc", "0", str(script)], "nproc must be"),
        (["--nproc", "1", "--out", str(ro / "sub" / "run"), str(script)], "Pass an --out path you can write to"),
    ]
    if os.geteuid() == 0:  # root writes anywhere: use a path under a regular file instead
        cases[2] = (["--nproc", "1", "--out", str(script / "run"), str(script)], "Pass an --out path you can write to")
    for args, fix in cases:
        p = subprocess.run(labkit_cli("launch", *args), capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and fix in p.stderr, (args, p.stderr)


def test_existing_run_directory_is_never_overwritten(tmp_path):
    out = tmp_path / "used"
    out.mkdir()
    (out / "result.json").write_text("{}")
    p = subprocess.run(labkit_cli("run", "--schedule", "GPipe", "--out", str(out)), capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "never overwritten" in p.stderr
    assert (out / "result.json").read_text() == "{}"


# 7. safety -----------------------------------------------------------------------------------------

def _listeners(pids: set[int]) -> list[str]:
    """Local addresses that processes in `pids` LISTEN on, read with ss."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
    found = []
    for line in out.splitlines():
        m = re.search(r"\s(\S+):(\d+)\s+\S+\s+users:\((.*)\)", line)
        if m and {int(x) for x in re.findall(r"pid=(\d+)", m.group(3))} & pids:
            found.append(m.group(1))
    return found


@pytest.mark.skipif(not Path("/usr/bin/ss").exists() and not Path("/bin/ss").exists(), reason="needs ss (iproute2)")
@pytest.mark.launches
def test_single_node_job_listens_on_loopback_only(write, tmp_path, runs):
    proc, out = _start_driver(write, tmp_path, HELLO, sleep="8")
    job = _wait_for_ranks(out, 2)
    addrs = _listeners({p.pid for p in job})
    proc.wait(timeout=60)
    assert addrs, "found no listening sockets of the job (ss output format changed?)"
    assert all(a in ("127.0.0.1", "[::1]") for a in addrs), addrs
    print(f"listeners of the job: {addrs}")


def test_no_shell_strings_and_no_unpickling():
    sources = list((REPO / "labkit").rglob("*.py")) + list((REPO / "scripts").glob("*.py"))
    # The live ranks' channel unpickles frames, only from a peer that proved the pool's secret
    # (tests/test_ranks.py sends it frames without the secret and with a wrong one).
    authenticated = {REPO / "labkit" / "ranks" / "channel.py"}
    for f in sources:
        text = f.read_text()
        assert "shell=True" not in text and "os.system(" not in text and "os.popen(" not in text, f
        assert "torch.load(" not in text, f
        if f in authenticated:
            assert "hmac.compare_digest" in text, f
        else:
            assert "pickle.load" not in text, f
    argv = json.loads  # command.json holds an argv list, checked in test_launch


# 8. multi-node ---------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.launches
def test_two_torchrun_agents_form_one_two_node_job(write, runs):
    script = write(HELLO, "hello.py")
    endpoint = f"127.0.0.1:{_free_port()}"
    procs = [subprocess.Popen(labkit_cli("launch", "--nproc", "1", "--nnodes", "2", "--node-rank", str(i),
                                         "--rdzv-endpoint", endpoint, "--quiet", "--out", str(runs / f"node{i}"),
                                         str(script)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outs)
    seen = [next((runs / f"node{i}").glob("logs/*/attempt_0/0/stdout.log")).read_text().strip() for i in range(2)]
    assert seen == ["rank 0 of 2 started", "rank 1 of 2 started"], "--node-rank must decide the global ranks"


@pytest.mark.launches
def test_slurm_script_runs_a_two_node_job_through_srun(tmp_path, runs):
    """Write the batch script, then run it with stand-ins for srun/scontrol that start both 'nodes' here."""
    from labkit.launching.slurm import slurm_script

    text = slurm_script(["run", "--schedule", "GPipe", "--nproc", "1", "--preset", "tiny", "--quiet"],
                        nodes=2, gpus_per_node=0, python=sys.executable, port=_free_port(), runs_root=str(runs))
    job = tmp_path / "job.sbatch"
    job.write_text(text)
    assert subprocess.run(["bash", "-n", str(job)]).returncode == 0
    assert "#SBATCH --nodes=2" in text and "srun" in text and "--node-rank $SLURM_NODEID" in text
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # a long node list after the head: a script that stops reading early dies of SIGPIPE under pipefail
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho 127.0.0.1\nfor i in $(seq 20000); do echo node$i; done\n")
    (bin_dir / "srun").write_text(textwrap.dedent("""\
        #!/bin/bash
        # stand-in: start one task per 'node' on this machine with its SLURM_NODEID
        while [[ $1 == --* ]]; do shift; done
        for i in 0 1; do SLURM_NODEID=$i "$@" & done
        wait -n && wait -n
    """))
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "n[1-2]",
           "SLURM_JOB_ID": "4242", "PYTHONPATH": str(REPO)}
    p = subprocess.run(["bash", str(job)], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert not (runs / "slurm-4242" / "node1" / "result.json").exists(), "global rank 0 must run on node 0"
    res = json.loads((runs / "slurm-4242" / "node0" / "result.json").read_text())
    assert res["pp_size"] == 2 and res["reference_match"] is True
