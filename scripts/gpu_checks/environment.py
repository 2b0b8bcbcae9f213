"""The check's environment: versions and the device (torch imported only on a GPU), and what the processes
it starts need from a plain checkout (the repository on PYTHONPATH, torchrun's way to the kit's rendezvous)."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path

from .common import REPO


def environment(device: str) -> dict:
    """Versions and the device, read without importing torch on CPU. On a GPU torch is imported (the
    launcher checks a GPU per rank anyway) but no CUDA context is made here: the name comes from
    nvidia-smi, and part 4's rank reports it too."""
    from importlib import metadata

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    env = {"device": device, "python": platform.python_version(), "torch": version("torch"),
           "transformers": version("transformers"), "host": platform.node(), "commit": git_commit(),
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    if device == "cuda":
        import torch

        env.update(torch=torch.__version__, cuda=torch.version.cuda, gpus=torch.cuda.device_count(),
                   device_name=gpu_name())
    else:
        env.update(device_name=cpu_model(), cpus=os.cpu_count())
    return env


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def gpu_name() -> str:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=20)
        return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else "a CUDA device"
    except (OSError, subprocess.SubprocessError):
        return "a CUDA device"


def git_commit() -> str | None:
    try:
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=5)
        return r.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def prepare_children(out: Path) -> str:
    """What every process the check starts needs from a plain checkout: the repository on PYTHONPATH
    (absolute: the ranks may start elsewhere), and torchrun's way to the kit's loopback rendezvous.

    torchrun finds `--rdzv-backend labkit-loopback` through the `torchrun.handlers` entry point that an
    installed labkit declares (pyproject.toml). A plain checkout declares none, so this declares the same
    entry point in a metadata folder of the output directory, on PYTHONPATH: the launch is then exactly
    the kit's own, loopback stores included. Returns how the rendezvous is found (for the report)."""
    from importlib.metadata import entry_points

    from labkit.launching.rendezvous import BACKEND_NAME

    paths = [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(REPO)]
    if any(ep.name == BACKEND_NAME for ep in entry_points(group="torchrun.handlers")):
        how = "the installed kit's torchrun.handlers entry point"
    else:
        plugin = out / "_rendezvous_plugin"
        info = plugin / "labkit_gpu_check_rendezvous-0.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: labkit-gpu-check-rendezvous\nVersion: 0\n")
        (info / "entry_points.txt").write_text(
            f"[torchrun.handlers]\n{BACKEND_NAME} = labkit.launching.rendezvous:handler_generator\n")
        paths.append(str(plugin.resolve()))
        how = f"declared for this check in {plugin} (a plain checkout declares no entry point)"
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    return how


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
