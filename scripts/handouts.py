"""Workshop handouts: the executed notebooks as HTML pages that print cleanly, and PDFs printed by
Chromium (`python3 scripts/dev.py handouts`, which calls `build`).

What printing needs that a notebook page does not have:
- **math without a network**: `$...$` and `$$...$$` in markdown become MathML (latex2mathml), which
  Chromium draws by itself; the MathJax script (loaded from a CDN a printer or an offline room does
  not reach) is left out;
- **code that fits the page**: long lines wrap at the page edge instead of being cut;
- **widgets as text**: a widget's saved view is dropped, so its text form shows
  (`[progress bar: ...]`, `PP Lab explorer (...)`), never `HBox(children=(IntProgress(...`;
- **no test markers**: `# NBVAL_...` and `# NEEDS_TORCH ...` lines are for the test suite, not the reader.

`prepare` is pure (a notebook in, a notebook out) and is what tests/test_handouts.py checks.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

MARKER = re.compile(r"^\s*# (NBVAL_[A-Z_]+|NEEDS_TORCH [\d.]+)\s*$")
DISPLAY_MATH = re.compile(r"\$\$(.+?)\$\$", re.DOTALL)
INLINE_MATH = re.compile(r"(?<![\\$])\$(?!\s)([^$\n]+?)(?<!\s)\$(?!\d)")
CODE_SPAN = re.compile(r"(```.*?```|`[^`\n]*`)", re.DOTALL)
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
PRINT_CSS = """
<style>
/* handouts: wrap long code lines at the page edge, keep figures and cells whole on a page */
pre, .jp-OutputArea-output pre, .highlight pre { white-space: pre-wrap !important; overflow-wrap: anywhere; word-break: break-word; }
.jp-Cell, img { break-inside: avoid; }
img { max-width: 100% !important; height: auto; }
math[display="block"] { margin: 0.6em 0; }
</style>
"""


def to_mathml(latex: str, display: bool) -> str:
    from latex2mathml.converter import convert

    return convert(latex.strip(), display="block" if display else "inline")


def convert_math(markdown: str) -> str:
    """`$...$` / `$$...$$` outside code spans -> MathML (pure)."""
    parts = CODE_SPAN.split(markdown)
    for i in range(0, len(parts), 2):  # even parts are outside code
        text = DISPLAY_MATH.sub(lambda m: to_mathml(m.group(1), True), parts[i])
        parts[i] = INLINE_MATH.sub(lambda m: to_mathml(m.group(1), False), text)
    return "".join(parts)


def prepare(nb):
    """A copy of the notebook (nbformat node) ready to print: markers out, math as MathML, widgets as text."""
    import copy

    nb = copy.deepcopy(nb)
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = convert_math(cell.source)
        elif cell.cell_type == "code":
            lines = [line for line in cell.source.splitlines() if not MARKER.match(line)]
            cell.source = "\n".join(lines)
            for out in cell.get("outputs", []):
                data = out.get("data")
                if data and WIDGET_VIEW in data:
                    del data[WIDGET_VIEW]
    nb.metadata.pop("widgets", None)
    return nb


def to_html(nb) -> str:
    """HTML of a prepared notebook: figures embedded, no MathJax, print CSS added."""
    from nbconvert import HTMLExporter

    # Figures are outputs, embedded as data URIs by nbconvert in any case; embed_images=True would only add
    # markdown images (the notebooks have none) and sends markdown through a renderer that closes raw HTML
    # blocks at once: the MathML became empty elements followed by text, each <details> an empty toggle.
    exporter = HTMLExporter(embed_images=False)
    exporter.mathjax_url = ""
    html, _ = exporter.from_notebook_node(nb)
    html = html.replace("<details>", "<details open>")  # on paper every collapsed block is printed
    # Nothing from a CDN (MathJax, require.js for widgets): a printer or an offline room has no network.
    html = re.sub(r"<script[^>]*\bsrc=\"(?:https?:)?//[^\"]*\"[^>]*>\s*</script>", "", html)
    html = re.sub(r"<script[^>]*>\s*</script>", "", html)
    return html.replace("</head>", PRINT_CSS + "</head>", 1)


def print_pdf(html: Path, pdf: Path, chromium: str) -> None:
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                    "--no-pdf-header-footer", f"--print-to-pdf={pdf}", html.as_uri()],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)


def build(notebooks: list[Path], out: Path, pdf: bool = True, execute: bool = False) -> list[Path]:
    """HTML (and, with chromium, PDF) handouts of `notebooks` in `out`; the files written. `execute`
    runs each notebook again first (in memory: the committed notebooks are not touched)."""
    import nbformat

    out.mkdir(parents=True, exist_ok=True)
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    written = []
    for path in notebooks:
        html = out / f"{path.stem}.html"
        nb = nbformat.read(path, as_version=4)
        if execute:
            from nbclient import NotebookClient

            NotebookClient(nb, timeout=600, resources={"metadata": {"path": str(path.parent)}}).execute()
        html.write_text(to_html(prepare(nb)), encoding="utf-8")
        written.append(html)
        print(f"{html}", flush=True)
        if pdf and chromium:
            print_pdf(html, html.with_suffix(".pdf"), chromium)
            written.append(html.with_suffix(".pdf"))
            print(f"{html.with_suffix('.pdf')}", flush=True)
    if pdf and not chromium:
        print("PDF handouts skipped: no chromium found (apt-get install chromium); the HTML handouts are complete.")
    return written


if __name__ == "__main__":
    root = Path(__file__).resolve().parent.parent
    names = [a for a in sys.argv[1:] if not a.startswith("--")]
    nbs = [root / "notebooks" / (n if n.endswith(".ipynb") else n + ".ipynb") for n in names] if names else \
        sorted((root / "notebooks").glob("[0-9][0-9]*_*.ipynb"))
    missing = [nb.name for nb in nbs if not nb.exists()]
    if missing:
        have = ", ".join(nb.stem for nb in sorted((root / "notebooks").glob("[0-9][0-9]*_*.ipynb")))
        sys.exit(f"handouts: no notebook {', '.join(missing)} in notebooks/. Name one of: {have} "
                 f"(with or without .ipynb), or none for all.")
    build(nbs, root / "handouts", execute="--execute" in sys.argv)
    print(f"handouts written to {root / 'handouts'}")
