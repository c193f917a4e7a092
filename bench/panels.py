"""Line plots in side-by-side panels, for the benchmarks that draw QPS against clients."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

# a line: (label, xs, ys, matplotlib line style)
Line = tuple[str, Sequence[float], Sequence[float], str]


def save_panels(path: Path, panels: Sequence[tuple[str, Sequence[Line]]], *, xlabel: str, ylabel: str,
                ylog: bool = False, size: tuple[float, float] = (5.5, 4), legend_size: int = 7) -> None:
    """One panel per ``(title, lines)``, x on a log2 axis, written to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(size[0] * len(panels), size[1]), squeeze=False)
    for ax, (title, lines) in zip(axes[0], panels):
        for label, xs, ys, style in lines:
            ax.plot(xs, ys, style, marker="o", label=label)
        ax.set_xscale("log", base=2)
        if ylog:
            ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=legend_size)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
