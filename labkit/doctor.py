"""`labkit doctor`: what this machine can run, and a fix-it line for anything missing or out of its supported
range (labkit.versions.RANGES: older than the floor is a problem, newer than tested a warning; notebook 00)."""

from __future__ import annotations

import os
import platform

from .versions import RANGES, SUPPORTED, range_problem, text

LAB_PACKAGES = ("jupyterlab", "ipywidgets", "matplotlib", "nbval", "psutil", "numpy")
OPTIONAL = {"transformers": "pip install -e '.[models]' (or: pip install 'transformers>={floor}')",
            "ortools": "pip install -e '.[search]' (or: pip install 'ortools>={floor}')"}
"""Not needed by every lesson: missing is a warning, with the command that installs it."""


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
    for name, how in OPTIONAL.items():
        report["packages"][name] = _version(name)
        if report["packages"][name] is None:
            warnings.append(f"{name} is not installed (needed by {RANGES[name].needed_by}): "
                            + how.format(floor=RANGES[name].floor))
    for name in RANGES:  # every installed dependency against its supported range (labkit.versions)
        have = report["packages"][name] if name in report["packages"] else _version(name)
        if have:
            report["packages"][name] = have
        found = range_problem(name, have) if have else None
        if found and found[0] == "older":
            what, _, fix = found[1].partition(": ")
            problems.append({"what": what, "fix": fix})
        elif found:
            warnings.append(found[1])
    gpus, backends = 0, []
    if torch_v is None:
        problems.append({"what": "torch is not installed",
                         "fix": f"pip install 'torch>={text(SUPPORTED[0])}' "
                                "(or a CUDA build on GPU nodes, see README)"})
    else:
        import torch
        import torch.distributed as dist

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
    w = max(12, *(len(name) + 1 for name in r["packages"]))  # the names' column, 'transformers' included

    def row(label: str, value: str) -> str:
        return f"{label:<{w}}{value}".rstrip()

    lines = [row("python", f"{r['python']} ({r['platform']})"), row("cpus", str(r["cpus"])),
             row("gpus", f"{r['gpus']} {', '.join(r.get('gpu_names', []))}")]
    for name, v in r["packages"].items():
        lines.append(row(name, v or "MISSING"))
    lines.append(row("backends", ", ".join(r["backends"]) or "none"))
    lines.append(row("device", f"labkit runs on {r['default_device']} by default"
                     + ("" if r["gpus"] else " (no GPU: gloo ranks on the CPU cores)")))
    for warning in r.get("warnings", []):
        lines.append(row("WARNING", warning))
    for p in r["problems"]:
        lines.append(row("PROBLEM", p["what"]) + "\n" + row("  fix:", p["fix"]))
    lines.append("all good" if r["ok"] else f"{len(r['problems'])} problem(s) to fix")
    return "\n".join(lines)
