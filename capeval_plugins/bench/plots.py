"""PNG plots of a benchmark run: metric score against human score (correlation benchmarks, one panel per
metric) or accuracy per category (pairwise benchmarks, one bar per metric). matplotlib is imported here only,
through its object API (no pyplot, no global backend)."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np


def plot_path(report_or_name, out_dir: str | Path) -> Path:
    name = report_or_name if isinstance(report_or_name, str) else report_or_name.benchmark.name
    return Path(out_dir) / f"{name}.png"


def plot_report(report, out_dir: str | Path, inputs=()) -> Path:
    """Write ``<benchmark>.png`` into ``out_dir`` (made if missing) and return its path; written through
    :func:`capeval_plugins.files.write_output` (``inputs``: files it must not replace)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from capeval_plugins import files

    files.Folder.open(out_dir, create=True)[0].close()
    path = plot_path(report, out_dir)
    if report.kind == "correlation":
        fig = _scatter(report, Figure)
    else:
        fig = _bars(report, Figure)
    FigureCanvasAgg(fig)
    files.write_output(path, lambda f: fig.savefig(f, dpi=110, format="png"), inputs, "--plot")
    return path


def _scatter(report, Figure):
    names = list(report.runs)
    cols = min(3, len(names))
    rows = math.ceil(len(names) / cols)
    fig = Figure(figsize=(4.2 * cols, 3.6 * rows), layout="constrained")
    human = report.data.human
    levels = np.unique(human)
    # Discrete human ratings (Flickr8k: 1-4) would stack into lines: jitter them a little, seeded.
    jitter = 0.0
    if 1 < len(levels) <= 12:
        jitter = np.random.default_rng(0).uniform(-0.15, 0.15, len(human)) * np.min(np.diff(levels))
    stat = report.benchmark.protocol.primary
    for k, name in enumerate(names):
        ax = fig.add_subplot(rows, cols, k + 1)
        scores = report.runs[name].scores
        ok = np.isfinite(scores)
        ax.scatter(scores[ok], (human + jitter)[ok], s=4, alpha=0.25, linewidths=0)
        value = report.evaluations[name].stats[stat]
        ax.set_title(f"{name}: {stat.replace('kendall_', '')} = {value:.1f}", fontsize=10)
        ax.set_xlabel(f"{name} score")
        ax.set_ylabel("human score")
    fig.suptitle(f"{report.benchmark.title}: metric vs human score ({len(human):,} rows)")
    return fig


def _bars(report, Figure):
    names = list(report.runs)
    first = report.evaluations[names[0]]
    cats = list(first.category_sizes)
    graded = [k for k in first.stats if k.startswith("accuracy:")]  # DOCENT: accuracy per judgment type
    groups = cats + (["mean"] if "accuracy" in first.stats else []) + [k.split(":", 1)[1] for k in graded]
    fig = Figure(figsize=(1.2 + 1.1 * len(groups) * max(1, len(names)) ** 0.5, 3.8), layout="constrained")
    ax = fig.add_subplot(1, 1, 1)
    width = 0.8 / len(names)
    x = np.arange(len(groups))
    for k, name in enumerate(names):
        stats = report.evaluations[name].stats
        values = [stats[f"category:{c}"] for c in cats] + ([stats["accuracy"]] if "mean" in groups else []) + \
            [stats[k] for k in graded]
        ax.bar(x + (k - (len(names) - 1) / 2) * width, values, width, label=name)
    ax.set_xticks(x, groups)
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(0, 100)
    ax.axhline(50, color="grey", linewidth=0.8, linestyle=":")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(f"{report.benchmark.title}: pairwise accuracy per category")
    return fig
