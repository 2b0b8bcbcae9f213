"""The explorer in a real JupyterLab, driven by headless Chromium (Playwright's Python package).

Starts JupyterLab on 127.0.0.1 (a port the OS picks, a token, a temporary root holding one small
notebook), opens the notebook, runs all cells, changes controls, checks the ideal timeline follows,
presses Run, waits for the measured timeline of a real torchrun job, and checks the DOM. Screenshots
go to test-artifacts/browser/ (ignored by git). Every process it starts is ended.

Needs the system `chromium` (Debian package) and `pip install playwright`; `python3 scripts/dev.py test`
installs both (`ensure_browser`). Playwright's own browser download is never used. Without them the
test skips and says why.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from conftest import REPO, kit_processes

pytestmark = pytest.mark.launches  # every test here starts, or runs on, processes that import torch

ARTIFACTS = REPO / "test-artifacts" / "browser"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking"]
RUN_TIMEOUT_MS = 180_000

NOTEBOOK_CELLS = [
    "import sys\nimport labkit\nprint('kernel prefix:', sys.prefix)",
    "labkit.explorer(runs_root='runs', timeout=170)",
]


# The kernel redraws the theory (simulation + PNG) on each change; a loaded 2-core CI machine can take
# several seconds, longer than Playwright's 5 s default.
UI_TIMEOUT_MS = 60_000


def _requirements() -> str | None:
    """Why the test cannot run here, or None."""
    if shutil.which("chromium") is None:
        return ("chromium is not installed (Debian: apt-get install chromium; `python3 scripts/dev.py test` "
                "does it when run as root)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright Python package is not installed (`python3 scripts/dev.py test` installs it)"
    for module in ("jupyterlab", "ipywidgets", "ipykernel"):
        try:
            __import__(module)
        except ImportError:
            return f"{module} is not installed (pip install -e '.[lab]')"
    return None


# Live ranks: a %%ranks cell whose ranks print for a few seconds; the page must show their lines
# while the cell still runs, then the whole output grouped by rank.
RANKS_CELLS = [
    "%load_ext labkit",
    "%ranks start --nproc 2",
    "%%ranks\nimport time\nfor i in range(6):\n    print(f'tick {i} of rank {rank}', flush=True)\n    time.sleep(1.5)",
    "%ranks stop\nprint('pool stopped')",
]


def _notebook(sources=NOTEBOOK_CELLS) -> dict:
    cells = [{"cell_type": "code", "execution_count": None, "id": f"cell-{i}", "metadata": {}, "outputs": [],
              "source": src} for i, src in enumerate(sources)]
    return {"cells": cells, "nbformat": 4, "nbformat_minor": 5,
            "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3 (ipykernel)",
                                        "language": "python"},
                         "language_info": {"name": "python"}}}


def _start_server(root: Path, home: Path, notebook: str = "explorer.ipynb") -> tuple[subprocess.Popen, str, Path]:
    """JupyterLab with the test's own python (so the `python3` kernel is this venv), isolated config."""
    token = os.urandom(16).hex()
    dirs = {name: home / name for name in ("config", "data", "runtime", "settings", "workspaces")}
    for d in dirs.values():
        d.mkdir(parents=True)
    # No news / update checks: the page must not reach the network, and no toast may cover the panel.
    settings = dirs["settings"] / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False, "doNotDisturbMode": True}))
    (dirs["config"] / "jupyter_lab_config.json").write_text(json.dumps(
        {"LabApp": {"news_url": None, "check_for_updates_class": "jupyterlab.NeverCheckForUpdate"}}))
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(dirs["config"]), JUPYTER_DATA_DIR=str(dirs["data"]),
               JUPYTER_RUNTIME_DIR=str(dirs["runtime"]), JUPYTERLAB_SETTINGS_DIR=str(dirs["settings"]),
               JUPYTERLAB_WORKSPACES_DIR=str(dirs["workspaces"]), MPLBACKEND="Agg", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env.pop("JUPYTER_PATH", None)
    log = open(home / "server.log", "wb")
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", "--port=0",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
           "--ServerApp.open_browser=False", "--LabApp.extension_manager=readonly"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # containers and CI machines run as root
        cmd.append("--allow-root")
    server = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, start_new_session=True)
    log.close()
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:  # the runtime file names the port the OS picked
        if server.poll() is not None:
            raise RuntimeError(f"JupyterLab exited with {server.returncode}:\n{(home / 'server.log').read_text()}")
        for f in dirs["runtime"].glob("jpserver-*.json"):
            try:
                info = json.loads(f.read_text())
            except ValueError:
                continue
            base = f"http://127.0.0.1:{info['port']}"
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5) as r:
                    if r.status == 200:
                        return server, f"{base}/lab/tree/{notebook}?token={token}", dirs["runtime"]
            except OSError:
                pass
        time.sleep(0.5)
    raise RuntimeError(f"JupyterLab did not answer within 90 s:\n{(home / 'server.log').read_text()}")


def _stop_server(server: subprocess.Popen) -> None:
    """SIGTERM (JupyterLab shuts its kernels down), then SIGKILL for anything of it still alive."""
    try:
        family = [psutil.Process(server.pid), *psutil.Process(server.pid).children(recursive=True)]
    except psutil.Error:
        family = []
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            pass
    gone, alive = psutil.wait_procs(family, timeout=10)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)
    if server.poll() is None:
        server.kill()
        server.wait(5)


def _painted(page) -> None:
    """Let the page paint what the DOM holds (headless Chromium can keep showing an older frame)."""
    page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")
    page.wait_for_timeout(300)


def _require_browser() -> None:
    reason = _requirements()
    if reason:
        if os.environ.get("CI"):  # CI must prove the kit works in a browser, never skip it quietly
            pytest.fail(f"browser test cannot run in CI: {reason}")
        pytest.skip(f"browser test skipped: {reason}")


def _open_and_run_all(page, url: str) -> None:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import expect

    page.set_default_timeout(60_000)
    page.goto(url)
    page.wait_for_selector(".jp-Notebook", timeout=90_000)
    # Run All before the session has its kernel makes JupyterLab ask for one: wait for the
    # status bar to show the connected, idle kernel first.
    expect(page.get_by_role("button", name="Python 3 (ipykernel) | Idle")).to_be_visible(timeout=90_000)
    page.click(".lm-MenuBar-itemLabel:text-is('Run')")
    page.click(".lm-Menu-item:has(.lm-Menu-itemLabel:text-is('Run All Cells'))")
    try:  # should the kernel still be starting, take the notebook's own (python3)
        page.locator(".jp-Dialog button", has_text="Select").click(timeout=3_000)
    except PlaywrightTimeout:
        pass


def _no_job_left(root: Path) -> None:
    left = [p for p in kit_processes(root.resolve()) if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for p in left:
        p.kill()
    assert not left, f"job processes left running: {[(p.pid, p.cmdline()) for p in left]}"


@contextlib.contextmanager
def _lab_page(tmp_path: Path, name: str, cells: list[str], viewport: dict):
    """A JupyterLab page on a fresh notebook of `cells`, all cells run; the server and every job it
    started are ended afterwards."""
    from playwright.sync_api import sync_playwright

    root = tmp_path / "lab"
    root.mkdir()
    (root / name).write_text(json.dumps(_notebook(cells), indent=1))
    server, url, _ = _start_server(root, tmp_path / "jupyter", name)
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=shutil.which("chromium"), args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport=viewport)
                _open_and_run_all(page, url)
                yield page
            finally:
                browser.close()
    finally:
        shutil.copy(tmp_path / "jupyter" / "server.log", ARTIFACTS / f"{Path(name).stem}-server.log")
        _stop_server(server)
        _no_job_left(root)


def test_ranks_cell_streams_live_per_rank_in_jupyterlab(tmp_path):
    """A %%ranks cell in a real JupyterLab: each rank's lines appear while the cell still runs (not
    only when it ends), then the cell holds the whole output grouped by rank."""
    _require_browser()
    from playwright.sync_api import expect

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with _lab_page(tmp_path, "ranks.ipynb", RANKS_CELLS, {"width": 1300, "height": 1200}) as page:
        out = page.locator(".jp-CodeCell").nth(2).locator(".jp-OutputArea")
        expect(out).to_contain_text("[rank0] tick 0 of rank 0", timeout=120_000)
        expect(out).to_contain_text("[rank1] tick 0 of rank 1", timeout=10_000)
        live = out.inner_text()
        assert "tick 5" not in live, live  # seen while the cell still runs: live, not at the end
        _painted(page)
        page.screenshot(path=str(ARTIFACTS / "10-ranks-live.png"))
        expect(page.locator(".jp-CodeCell").nth(3).locator(".jp-OutputArea")).to_contain_text(
            "pool stopped", timeout=120_000)
        final = out.inner_text()
        lines = [l for l in final.splitlines() if l.startswith("[rank")]
        assert lines == [f"[rank{r}] tick {i} of rank {r}" for r in (0, 1) for i in range(6)], final
        _painted(page)
        page.screenshot(path=str(ARTIFACTS / "11-ranks-done.png"))


def test_explorer_in_jupyterlab(tmp_path):
    _require_browser()
    from playwright.sync_api import expect

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for old in ARTIFACTS.glob("0*.png"):
        old.unlink()
    with _lab_page(tmp_path, "explorer.ipynb", NOTEBOOK_CELLS, {"width": 1500, "height": 2100}) as page:
        # The kernel is this test's python (the server's sys.executable runs the python3 kernelspec).
        expect(page.locator(".jp-OutputArea-output").first).to_contain_text(
            f"kernel prefix: {sys.prefix}", timeout=120_000)
        panel = page.locator(".jp-OutputArea .pplab-explorer")
        expect(panel).to_be_visible(timeout=120_000)
        theory = panel.locator(".pplab-theory-bubble")
        expect(theory).to_contain_text("Ideal GPipe, pp_size=2, 4 microbatches")
        expect(theory).to_contain_text("bubble_fraction 20.0%")
        expect(panel.locator("img.pplab-theory-image")).to_be_visible()
        expect(panel.locator(".pplab-run")).to_be_enabled()
        expect(panel.locator(".pplab-stop")).to_be_disabled()
        expect(panel.locator("img.pplab-timeline")).to_be_hidden()
        expect(panel.locator(".pplab-error")).to_be_hidden()
        _painted(page)
        page.screenshot(path=str(ARTIFACTS / "01-displayed.png"))

        # An invalid combination is explained and Run is disabled.
        mb = panel.locator(".pplab-microbatches input")
        mb.fill("3")
        mb.press("Tab")
        expect(panel.locator(".pplab-error")).to_contain_text("not divisible by 3 microbatches", timeout=UI_TIMEOUT_MS)
        expect(panel.locator(".pplab-run")).to_be_disabled(timeout=UI_TIMEOUT_MS)

        # A valid change: the ideal timeline follows at once.
        before = panel.locator("img.pplab-theory-image").get_attribute("src")
        panel.locator(".pplab-schedule select").select_option(label="1F1B")
        # As a learner sees it: the kernel has redrawn for the new schedule before the next edit. Typing
        # while that change is still in flight raced ipywidgets' echo of the old value on a loaded CI
        # machine (the box went back to 3 and stayed there).
        expect(theory).to_contain_text("Ideal 1F1B, pp_size=2, 3 microbatches", timeout=UI_TIMEOUT_MS)
        mb.fill("8")
        mb.press("Tab")
        expect(theory).to_contain_text("Ideal 1F1B, pp_size=2, 8 microbatches", timeout=UI_TIMEOUT_MS)
        expect(theory).to_contain_text("bubble_fraction 11.1%", timeout=UI_TIMEOUT_MS)  # (p-1)/(m+p-1) = 1/9
        expect(theory).to_contain_text("bubble_ratio 0.12", timeout=UI_TIMEOUT_MS)      # (p-1)/m = 1/8
        expect(panel.locator(".pplab-error")).to_be_hidden(timeout=UI_TIMEOUT_MS)
        expect(panel.locator(".pplab-run")).to_be_enabled(timeout=UI_TIMEOUT_MS)
        assert panel.locator("img.pplab-theory-image").get_attribute("src") != before
        _painted(page)
        page.screenshot(path=str(ARTIFACTS / "02-controls-changed.png"))

        panel.locator(".pplab-run").click()
        expect(panel.locator(".pplab-status")).to_contain_text("running 1F1B")
        timeline = panel.locator("img.pplab-timeline")
        timeline.wait_for(state="visible", timeout=RUN_TIMEOUT_MS)
        status = panel.locator(".pplab-status")
        expect(status).to_contain_text("ok: reference match")
        rows = panel.locator(".pplab-history table.pplab-history-table tbody tr")
        expect(rows).to_have_count(1)
        cells = [c.strip() for c in rows.first.locator("td").all_inner_texts()]
        assert cells[1:8] == ["1F1B", "2", "1", "8", "manual", "ok", "yes"], cells
        assert "%" in cells[8] and "%" in cells[9] and cells[10].endswith(" s"), cells  # bubbles, step time
        expect(panel.locator(".pplab-measured-bubble")).to_contain_text("bubble_fraction")
        expect(panel.locator(".pplab-log")).to_contain_text("matches the unsplit model")
        expect(panel.locator(".pplab-run")).to_be_enabled()
        expect(panel.locator(".pplab-stop")).to_be_disabled()
        box = timeline.bounding_box()
        assert box and box["width"] > 300 and box["height"] > 150, box
        timeline.scroll_into_view_if_needed()
        _painted(page)
        page.screenshot(path=str(ARTIFACTS / "03-after-run.png"))
        panel.screenshot(path=str(ARTIFACTS / "03-explorer-after-run.png"))
    assert (ARTIFACTS / "03-after-run.png").stat().st_size > 10_000
