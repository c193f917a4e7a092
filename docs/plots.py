"""Draw docs/performance.md's plots from the tables on that page: `.venv/bin/python docs/plots.py`.

Writes docs/img/scaleout-h200.png (the "Scale-out of a dedicated model" table) and
docs/img/overload.png (the two tables of "Overload"). Needs matplotlib (the `bench` extra).
"""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
PAGE = HERE / "performance.md"


def tables(heading: str) -> list[list[list[str]]]:
    """The markdown tables under ``## heading`` (up to the next ``## ``), as rows of cells."""
    text = PAGE.read_text().split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    found, rows = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if not set("".join(cells)) <= set("-: "):
                rows.append(cells)
        elif rows:
            found.append(rows)
            rows = []
    return found


def number(cell: str) -> float:
    """The first number of a cell: ``"3,649"`` -> 3649.0, ``"136 (18)"`` -> 136.0."""
    return float(re.match(r"[\d,.]+", cell).group().replace(",", ""))


def scaleout(out: Path) -> None:
    rows = tables("Scale-out of a dedicated model")[0][1:]
    series: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        server, k = row[0].split(", ")
        series.setdefault(server, []).append((int(k), number(row[1])))
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for server, points in series.items():
        ks, qps = zip(*points)
        ax.plot(ks, qps, marker="o", linestyle="-" if len(ks) > 1 else "none", label=server)
    ks = [k for k, _ in series["product"]]
    ax.plot(ks, [series["product"][0][1] * k for k in ks], linestyle=":", color="grey", label="linear")
    ax.set(xlabel="replicas", ylabel="QPS", xticks=ks,
           title="tiny_cnn on the H200, 128 clients (2026-12-01)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def overload(out: Path) -> None:
    h200, two_cores = tables("Overload")
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    levels = [number(c) for c in h200[0][1:]]
    for row in h200[1:]:
        left.plot(levels, [number(c) for c in row[1:]], marker="o", label=row[0])
    left.set(xscale="log", xlabel="clients", ylabel="QPS", title="H200, GPU (2026-12-01)")
    names = two_cores[0][1:]
    clients = [number(row[0]) for row in two_cores[1:]]
    for i, name in enumerate(names, start=1):
        right.plot(clients, [number(row[i]) for row in two_cores[1:]], marker="o",
                   color="C0" if name.startswith("ocr_cls") else "C1",
                   linestyle="--" if "Triton" in name else "-", label=name)
    right.set(xscale="log", xlabel="clients", ylabel="QPS", title="2 cores, CPU, with Triton (2026-12-01)")
    for ax in (left, right):
        ax.set_ylim(bottom=0)
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    (HERE / "img").mkdir(exist_ok=True)
    scaleout(HERE / "img" / "scaleout-h200.png")
    overload(HERE / "img" / "overload.png")
