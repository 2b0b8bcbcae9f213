"""`labkit doctor`: what this machine can run, and a fix-it line for anything missing (notebook 00)."""

from __future__ import annotations

import os
import platform

from .versions import SUPPORTED, parse, support_problem, text

LAB_PACKAGES = ("jupyterlab", "ipywidgets", "matplotlib", "nbval", "psutil", "numpy")


def _version(dist: str) -> str | None:
    """The installed version from package metadata (importing jupyterlab & co. just to ask costs seconds)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def doctor() -> dict:
    """A report dict: versions, CPUs, GPUs, which backends can run, and problems with their fixes."""
    problems: list[dict] = []
    warnings: list[str] = []
    report: dict = {"python": platform.python_version(), "platform": platform.platform(),
                    "cpus": os.cpu_count(), "packages": {}, "problems": problems, "warnings": warnings}
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
                         "fix": f"pip install 'torch>={text(SUPPORTED[0])}' (or a CUDA build on GPU nodes, see README)"})
    else:
        import torch
        import torch.distributed as dist

        unsupported = support_problem(torch_v)
        if unsupported and parse(torch_v) < SUPPORTED[0]:
            what, _, fix = unsupported.partition(": ")
            problems.append({"what": what, "fix": fix})
        elif unsupported:
            warnings.append(unsupported)
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
                             "fix": f"install torch>={text(SUPPORTED[0])} with distributed support"})
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
    for w in r.get("warnings", []):
        lines.append(f"WARNING     {w}")
    for p in r["problems"]:
        lines.append(f"PROBLEM     {p['what']}\n  fix:      {p['fix']}")
    lines.append("all good" if r["ok"] else f"{len(r['problems'])} problem(s) to fix")
    return "\n".join(lines)
