"""Where the quality benchmark's files go, and writing them.

Only ``--publish`` with the full plan writes the published files of a checkout
(``benchmarks/results/quality.json``, ``docs/quality-*.png``, the generated block of
``docs/quality.md``); any other run writes under ``--out DIR`` or a new temporary directory, and is
refused a ``--out`` that is the published place."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddiloco.bench.provenance import json_safe
from ddiloco.bench.quality.plan import GPU_SCALES
from ddiloco.bench.quality.report import GPU_BEGIN, GPU_END, docs_block, gpu_docs_block, rows_from_json, with_docs_block, with_targeted
from ddiloco.bench.quality.run import Row

PUBLISHED_RESULTS = Path("benchmarks") / "results" / "quality.json"
PUBLISHED_GPU_RESULTS = PUBLISHED_RESULTS.with_name("quality_gpu.json")
PUBLISHED_PLOTS = Path("docs")
DOCS_PAGE = PUBLISHED_PLOTS / "quality.md"
RESULTS_NAME = "quality.json"
GPU_RESULTS_NAME = "quality_gpu.json"
GPU_PLOT_STEM = "quality-gpu"


@dataclass(frozen=True)
class Destination:
    results: Path
    plots: Path
    """Folder of the quality-<model>[-ablations].png plots (quality-gpu-<model>.png for the GPU plan)."""
    docs_page: Path | None = None
    """docs/quality.md, whose generated block is rewritten (published runs only)."""
    gpu: bool = False
    """The GPU plan's files: its own results file, plot names and block of the docs page."""


def checkout(path: Path) -> Path | None:
    """``path`` resolved if it is a ddiloco checkout (the package, the docs page and the results
    folder are there), else None."""
    p = path.resolve()
    found = (p / "ddiloco").is_dir() and (p / DOCS_PAGE).is_file() and (p / PUBLISHED_RESULTS).parent.is_dir()
    return p if found else None


def destination(out: Path | None, *, publish: bool, full_plan: bool, repo: Path | None, gpu: bool = False) -> Destination:
    """Where a run's files go (without ``out`` or ``publish``: a new temporary directory, made here);
    ``repo`` is the checkout the command runs in (or was given), if any. The GPU plan publishes row by row
    (``full_plan``: not --quick), into its own results file and block of the docs page.

    Raises ValueError, saying what to change, for a publish that is not of the full plan or has no
    checkout, and for an ``out`` that would overwrite the published files."""
    if publish:
        if not full_plan:
            raise ValueError("--publish writes the published results: it needs the full plan (--scale gpu: without --quick; "
                             "otherwise no --quick, --only, --no-ablations, --no-sweep, and every model)")
        if out is not None:
            raise ValueError("--publish writes into the checkout; leave out --out")
        if repo is None:
            raise ValueError("--publish needs a ddiloco checkout: run it from one, or pass --repo PATH")
        return Destination(repo / (PUBLISHED_GPU_RESULTS if gpu else PUBLISHED_RESULTS), repo / PUBLISHED_PLOTS, repo / DOCS_PAGE, gpu)
    if out is None:
        out = Path(tempfile.mkdtemp(prefix="ddiloco-bench-quality-"))
    elif repo is not None and out.resolve() in ((repo / PUBLISHED_RESULTS).parent.resolve(), (repo / PUBLISHED_PLOTS).resolve()):
        raise ValueError(f"--out {out} is where the published results are; only --publish with the full plan writes there")
    return Destination(out / (GPU_RESULTS_NAME if gpu else RESULTS_NAME), out, gpu=gpu)


def read_rows(dest: Destination) -> list[Row]:
    """The rows a destination's results file already holds (none when there is no file yet)."""
    if not dest.results.is_file():
        return []
    return rows_from_json(json.loads(dest.results.read_text()))


def write_results(result: dict[str, Any], dest: Destination) -> None:
    """The results file alone, written whole through a temporary file (a command killed mid-write leaves the old one)."""
    dest.results.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.results.with_name(dest.results.name + ".tmp")
    tmp.write_text(json.dumps(json_safe(result), indent=1) + "\n")
    tmp.replace(dest.results)


def write(result: dict[str, Any], rows: Sequence[Row], dest: Destination) -> list[Path]:
    """Write the results file, the plots and (if the destination has one) the docs page; returns what was written."""
    write_results(result, dest)
    written = [dest.results, *save_plots(rows, dest.plots, GPU_PLOT_STEM if dest.gpu else "quality")]
    if dest.docs_page is not None:
        page = dest.docs_page.read_text()
        if dest.gpu:
            page = with_docs_block(page, gpu_docs_block(result, rows, GPU_PLOT_STEM), GPU_BEGIN, GPU_END)
        else:
            page = with_docs_block(page, docs_block(result, rows))
        dest.docs_page.write_text(page)
        written.append(dest.docs_page)
    return written


def add_targeted(result: dict[str, Any], repo: Path) -> list[Path]:
    """Add a run of a few rows to ``repo``'s published results as a targeted run (the full run's rows
    and plots stay as they are) and rewrite the docs page's generated block; returns what was written."""
    results, page = repo / PUBLISHED_RESULTS, repo / DOCS_PAGE
    merged = with_targeted(json.loads(results.read_text()), json_safe(result))
    results.write_text(json.dumps(merged, indent=1) + "\n")
    page.write_text(with_docs_block(page.read_text(), docs_block(merged, rows_from_json(merged))))
    return [results, page]


STYLE = {
    "data_parallel": ("black", "-"),
    "diloco": ("tab:red", "-"),
    "streaming_diloco": ("tab:orange", "--"),
    "decoupled": ("tab:blue", "-"),
    "decoupled_stragglers": ("tab:green", "-."),
    "decoupled_failures": ("tab:purple", ":"),
    "diloco_stragglers": ("tab:green", (0, (1, 1))),
    "diloco_failures": ("tab:purple", (0, (5, 1, 1, 1))),
    "decoupled_chaos": ("tab:green", "-."),
}
"""(colour, line style) of the main rows, the same in every plot."""


def save_plots(rows: Sequence[Row], out_dir: Path, stem: str = "quality") -> list[Path]:
    """<stem>-<model>.png: val loss vs tokens and vs simulated wall-clock, one line per regime;
    and <stem>-<model>-ablations.png for a model with ablations."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for model in dict.fromkeys(r.model for r in rows):
        mine = [r for r in rows if r.model == model]
        # The GPU plan's few follow-up rows (sweep rows of its decoupled and chaos rows, and rows at other seeds) go on its one
        # plot.
        gpu = mine[0].scale in GPU_SCALES
        main = [r for r in mine if r.group in ("regime", "reference") or (gpu and r.group in ("sweep", "noise"))]
        extra = [] if gpu else [r for r in mine
                                if r.group in ("ablation", "sweep", "noise") or r.regime in ("decoupled", "decoupled_stragglers")]
        for kind, sel in (("", main), ("-ablations", extra)):
            if not sel or (kind and len(sel) <= 2):
                continue
            fig, axes = plt.subplots(1, 2, figsize=(14, 4.6), dpi=100)
            cmap = plt.get_cmap("tab20")
            for i, r in enumerate(sel):
                # The GPU plan's follow-ups: dashed, in tab10's colours that no main row has.
                other = (plt.get_cmap("tab10")(5 + i % 5), "--") if gpu else (cmap(i % 20), "-")
                color, ls = STYLE.get(r.regime, other)
                if gpu and r.group == "noise" and r.base in STYLE:
                    color, ls = STYLE[r.base][0], ":"  # the same row at another seed: its colour, dotted
                pts = [c for c in r.curve if c[2] is not None]
                label = f"{r.regime} ({r.val_loss:.3f})"
                axes[0].plot([c[0] for c in pts], [c[2] for c in pts], linestyle=ls, color=color, label=label, lw=1.6)
                axes[1].plot([c[1] for c in pts], [c[2] for c in pts], linestyle=ls, color=color, label=label, lw=1.6)
            unit = "examples" if model == "vision" else "tokens"
            axes[0].set_xlabel(f"{unit} trained (all learners)")
            axes[1].set_xlabel("simulated wall-clock (s; one full-speed step = 1 s)")
            lo = min(c[2] for r in sel for c in r.curve if c[2] is not None)
            hi = min(max(c[2] for r in sel for c in r.curve if c[2] is not None), lo * 1.8 + 0.5)
            if kind:  # many close lines: show the second half of training, where they differ
                hi = max(c[2] for r in sel for c in r.curve if c[2] is not None and c[0] >= 0.5 * r.tokens)
            for ax in axes:
                ax.set_ylabel("validation loss")
                ax.grid(alpha=0.3)
                ax.set_ylim(lo - 0.05 * abs(lo), hi + 0.02 * abs(hi))
            axes[1].legend(fontsize=7.5, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
            at = f" ({mine[0].scale} scale)" if gpu else ""
            fig.suptitle(f"{model}{at}: validation loss by regime{' (ablations and sweep)' if kind else ''}")
            fig.tight_layout()
            p = out_dir / f"{stem}-{model}{kind}.png"
            fig.savefig(p)
            plt.close(fig)
            paths.append(p)
    return paths
