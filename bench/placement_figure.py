"""The README's placement picture from a ``bench.placement`` run's JSON: ``hash`` against
``bytes`` at one client count, two panels.

* Left: each pool replica's resident bytes at the end of the steady window against its budget
  (``resident_bytes_by_replica``, ``budget_bytes``), with the copies of the hot models under
  ``bytes`` (``copies``) written above its bars.
* Right: cold loads per 1,000 requests in the steady window and in each ``BUCKET_S`` after the
  popularity shift (``after_shift``).

    .venv/bin/python -m bench.placement_figure RUN.json docs/img/placement.png [--clients 16]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Sequence

MIB = 2**20
COLORS = {"hash": "#c0504d", "bytes": "#1f77b4"}


def series(rows: Sequence[dict[str, Any]], clients: int) -> dict[str, dict[str, Any]]:
    """Per policy (``hash``, ``bytes``: those present) at ``clients``: ``resident_mib`` (the
    replicas' resident MiB, largest first), ``budget_mib``, ``copies`` (hot model -> copies),
    ``times_s`` and ``cold_per_1000``: the steady window at -10 s (left of the shift), then
    each bucket after the shift at its middle. Raises ValueError naming what a row lacks."""
    out = {}
    for r in rows:
        if r["clients"] != clients or r["placement"] not in COLORS:
            continue
        missing = [k for k in ("resident_bytes_by_replica", "after_shift") if not r.get(k)]
        if missing:
            raise ValueError(f"{r['placement']} at {clients} clients has no {', '.join(missing)}: "
                             "run bench.placement without --quick (its shift) from this version")
        buckets = r["after_shift"]
        out[r["placement"]] = {
            "resident_mib": sorted((b / MIB for b in r["resident_bytes_by_replica"].values() if b is not None),
                                   reverse=True),
            "budget_mib": r["budget_bytes"] / MIB, "copies": r.get("copies", {}),
            "times_s": [-10.0] + [b["from_s"] + 5.0 for b in buckets],
            "cold_per_1000": [r["cold_loads_per_1000"]] + [b["cold_loads_per_1000"] for b in buckets]}
    if not out:
        raise ValueError(f"no hash or bytes row at {clients} clients")
    return out


def draw(data: dict[str, dict[str, Any]], out: Path, clients: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4), gridspec_kw={"width_ratios": [1, 1.2]})
    width = 0.38
    for k, (policy, d) in enumerate(sorted(data.items())):
        xs = [i + (k - 0.5) * width for i in range(len(d["resident_mib"]))]
        left.bar(xs, d["resident_mib"], width, color=COLORS[policy], label=policy)
    budget = next(iter(data.values()))["budget_mib"]
    left.axhline(budget, color="black", linestyle="--", linewidth=1)
    left.text(-0.45, budget * 1.02, f"budget {budget:.0f} MiB", fontsize=8)
    copies = data.get("bytes", {}).get("copies", {})
    if copies:
        left.set_title("resident MiB per pool replica\nbytes: " + ", ".join(f"{m} x{c}" for m, c in sorted(copies.items())),
                       fontsize=9)
    else:
        left.set_title("resident MiB per pool replica", fontsize=9)
    left.set_xticks(range(max(len(d["resident_mib"]) for d in data.values())))
    left.set_xticklabels([f"r{i}" for i in range(max(len(d["resident_mib"]) for d in data.values()))])
    left.set_ylim(0, budget * 1.35)
    left.legend(fontsize=8, loc="upper right", ncol=2)
    for policy, d in sorted(data.items()):
        right.plot(d["times_s"], d["cold_per_1000"], marker="o", color=COLORS[policy], label=policy)
    right.axvline(0, color="gray", linewidth=1)
    right.text(0.5, right.get_ylim()[1] * 0.9, "popularity shift", fontsize=8, color="gray")
    right.set_xticks([-10] + [t for t in next(iter(data.values()))["times_s"][1:]])
    right.set_xticklabels(["steady"] + [f"{t - 5:.0f}-{t + 5:.0f} s" for t in next(iter(data.values()))["times_s"][1:]],
                          fontsize=7)
    right.set_xlabel("10 s after the shift", fontsize=8)
    right.set_title(f"cold loads per 1,000 requests ({clients} clients)", fontsize=9)
    right.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="bench.placement's --out JSON")
    parser.add_argument("out", type=Path, help="the PNG to write")
    parser.add_argument("--clients", type=int, default=16)
    a = parser.parse_args(argv)
    draw(series(json.loads(a.run.read_text())["rows"], a.clients), a.out, a.clients)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
