"""Start-up (labkit.core.startup): torch's heavy imports run with the cyclic collector paused, in every
process the launcher starts (the ranks' sitecustomize) and wherever the kit is imported before torch
(a notebook's kernel, the `labkit` command).

What is checked: the collector is back on after the imports and what they made is frozen; a collector
the script turned off stays off; LABKIT_GC_PAUSE=0 turns it off; a failing import still resumes the
collector; nothing is printed at exit (triton's nanobind bindings report frozen objects as leaks
unless they go back to the collector). What it saves is measured by `scripts/bench.py --only startup`.
"""

import gc
import json
import os
import subprocess
import sys
import textwrap

import pytest

from labkit.core import startup
from labkit.spans.paths import BOOT_DIR

pytestmark = pytest.mark.launches  # every test here starts, or runs on, processes that import torch

PROBE = textwrap.dedent("""
    import gc, json, sys
    facts = {"on_at_start": gc.isenabled()}
    import torch
    facts["frozen_after_torch"] = gc.get_freeze_count()
    import torch.distributed.pipelining
    facts["frozen_after_pipelining"] = gc.get_freeze_count()
    facts["on_after"] = gc.isenabled()
    print(json.dumps(facts))
""")


def probe(code: str, **env) -> tuple[dict, str]:
    """Run `code` as a rank's process starts (the boot folder first on PYTHONPATH); its last stdout
    line as JSON, and its stderr."""
    full = dict(os.environ, PYTHONPATH=os.pathsep.join([str(BOOT_DIR), os.environ.get("PYTHONPATH", "")]), **env)
    full.pop("LABKIT_SPANS_DIR", None)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=300)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


def test_a_rank_imports_torch_with_the_collector_paused_then_frozen_and_on_again():
    facts, err = probe(PROBE)
    assert facts["on_at_start"] and facts["on_after"]
    assert facts["frozen_after_torch"] > 50_000, facts  # torch's own objects, never walked again
    assert facts["frozen_after_pipelining"] > facts["frozen_after_torch"], facts
    assert err == "", f"nothing may be printed at start or exit (nanobind leak reports?):\n{err[-2000:]}"


def test_off_switch_and_a_collector_the_script_turned_off():
    facts, _ = probe(PROBE, LABKIT_GC_PAUSE="0")
    assert facts["frozen_after_pipelining"] == 0 and facts["on_after"]
    off, _ = probe("import gc, json; gc.disable(); import torch; print(json.dumps([gc.isenabled(), gc.get_freeze_count()]))")
    assert off == [False, 0]  # the script's choice is kept: nothing frozen, still off


def test_a_failing_heavy_import_resumes_the_collector(tmp_path, monkeypatch):
    (tmp_path / "heavy_but_broken.py").write_text("raise ImportError('broken on purpose')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(startup, "HEAVY", ("heavy_but_broken",))
    finder = startup.PausedImport()
    sys.meta_path.insert(0, finder)
    try:
        assert gc.isenabled()
        with pytest.raises(ImportError, match="broken on purpose"):
            import heavy_but_broken  # noqa: F401
        assert gc.isenabled()
    finally:
        sys.meta_path.remove(finder)
        sys.modules.pop("heavy_but_broken", None)
        gc.unfreeze()


def test_importing_the_kit_before_torch_pauses_it_as_in_a_kernel_or_the_labkit_command():
    """`import labkit` first (a notebook's kernel, the `labkit` command), then `labkit doctor`, which
    imports torch and its pipelining: what they made is frozen, the collector is on."""
    code = textwrap.dedent("""
        import contextlib, gc, io, json, sys
        from labkit.cli import main
        assert "torch" not in sys.modules
        with contextlib.redirect_stdout(io.StringIO()):
            rc = main(["doctor"])
        print(json.dumps([rc, "torch.distributed.pipelining" in sys.modules, gc.isenabled(), gc.get_freeze_count()]))
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={k: v for k, v in os.environ.items() if k != startup.OFF_VAR})
    assert p.returncode == 0, p.stderr
    rc, imported, on, frozen = json.loads(p.stdout.strip().splitlines()[-1])
    assert imported and on and frozen > 50_000, (rc, imported, on, frozen)
