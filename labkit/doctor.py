"""`labkit doctor`: what this machine can run, and a fix-it line for anything missing (notebook 00)."""

from __future__ import annotations

import os
import platform

MIN_TORCH = (2, 8)
LAB_PACKAGES = ("jupyterlab", "ipywidgets", "matplotlib", "nbval", "psutil", "numpy")


def _version(dist: str) -> str | None:
    """The installed version from package metadata (importing jupyterlab & co. just to ask costs seconds)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _torch_tuple(v: str) -> tuple[int, int]:
    parts = v.split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


def doctor() -> dict:
    """A report dict: versions, CPUs, GPUs, which backends can run, and problems with their fixes."""
    problems: list[dict] = []
    report: dict = {"python": platform.python_version(), "platform": platform.platform(),
                    "cpus": os.cpu_count(), "packages": {}, "problems": problems}
    torch_v = _version("torch")
    report["packages"]["torch"] = torch_v
    for name in LAB_PACKAGES:
        report["packages"][name] = _version(name)
        if report["packages"][name] is None:
            problems.append({"what": f"{name} is not installed",
                             "fix": f"pip install -e '.[lab,test]' (or: pip install {name})"})
    gpus, backends = 0, []
    if torch_v is None:
        problems.append({"what": "torch is not installed",
                         "fix": "pip install torch==2.13.0 (CPU laptops), or a CUDA build on GPU nodes (see README)"})
    else:
        import torch
        import torch.distributed as dist

        if _torch_tuple(torch_v) < MIN_TORCH:
            problems.append({"what": f"torch {torch_v} is older than {MIN_TORCH[0]}.{MIN_TORCH[1]}",
                             "fix": "pip install 'torch>=2.8' (2.13.0 on CPU machines)"})
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if dist.is_available() and dist.is_gloo_available():
            backends.append("gloo (CPU ranks)")
        if gpus and dist.is_nccl_available():
            backends.append(f"nccl (up to {gpus} rank(s), one GPU each)")
        report["cuda"] = torch.version.cuda
        report["gpu_names"] = [torch.cuda.get_device_name(i) for i in range(gpus)]
        try:
            import torch.distributed.pipelining  # noqa: F401
        except Exception as e:  # pragma: no cover - depends on the torch build
            problems.append({"what": f"torch.distributed.pipelining does not import: {e}",
                             "fix": "install torch>=2.8 with distributed support"})
        if not backends:
            problems.append({"what": "no distributed backend available",
                             "fix": "install a torch build with distributed support (the PyPI wheels have it)"})
    report["gpus"] = gpus
    report["backends"] = backends
    report["default_device"] = "cuda" if gpus else "cpu"
    report["ok"] = not problems
    return report


def format_report(r: dict) -> str:
    lines = [f"python      {r['python']} ({r['platform']})", f"cpus        {r['cpus']}",
             f"gpus        {r['gpus']} {', '.join(r.get('gpu_names', []))}".rstrip()]
    for name, v in r["packages"].items():
        lines.append(f"{name:<11} {v or 'MISSING'}")
    lines.append(f"backends    {', '.join(r['backends']) or 'none'}")
    lines.append(f"device      labkit runs on {r['default_device']} by default"
                 + ("" if r["gpus"] else " (no GPU: gloo ranks on the CPU cores)"))
    for p in r["problems"]:
        lines.append(f"PROBLEM     {p['what']}\n  fix:      {p['fix']}")
    lines.append("all good" if r["ok"] else f"{len(r['problems'])} problem(s) to fix")
    return "\n".join(lines)
