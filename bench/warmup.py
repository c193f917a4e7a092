"""First request after a load against the steady p50, with and without a ``warmup:`` section.

The engine layer alone (a ``ModelHost`` per load, no Ray, no HTTP), so the figure is the
model's own start-up cost. For each model and round, both variants are loaded in turn (the
order alternates between rounds); after each load: one timed first request, then
``--requests`` more whose median is the steady p50. The warmup variant is the model's config
with ``warmup: {batch_sizes: [1], data: zeros}``; the request is batch 1 of random FP32.
``--backend`` picks the engine as ``ModelHost`` does in the server (``onnxruntime_cuda``: ONNX
Runtime's CUDA provider, needs ``onnxruntime-gpu`` and a CUDA GPU; ``bench/h200.sh warmup``).

    .venv/bin/python -m bench.warmup [--models tiny_cnn,resnet18,ocr_cls] [--rounds 5] [--requests 30]
        [--backend onnxruntime] [--out bench/results]

Prints a table (with the backend each load used) and writes ``warmup.json`` to ``--out``. ONNX Runtime runs one intra-op thread
per session (``ORT_INTRA_OP_THREADS=1``, as in the other benchmarks) unless the environment says.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, Sequence, get_args

import numpy as np

from deployments.runtime.contract.config import Backend

RESULTS = Path(__file__).resolve().parent / "results"


def one_load(entry: Any, warm: bool, requests: int, rng: np.random.Generator,
             backend: str = "onnxruntime") -> dict[str, Any]:
    from deployments.runtime.contract.config import Warmup
    from deployments.runtime.contract.repository import ModelEntry
    from deployments.runtime.residency.host import ModelHost
    from deployments.runtime.residency.warmup import warmup_shape

    config = entry.config.model_copy(update={"warmup": Warmup(batch_sizes=(1,)) if warm else None})
    host = ModelHost(ModelEntry(config=config, path=entry.path, versions=entry.versions), backend).load()
    inputs = {s.name: rng.random(warmup_shape(config, s, 1), dtype=np.float32) for s in config.inputs}
    try:
        times = []
        for _ in range(requests + 1):
            start = time.perf_counter()
            host.infer(inputs)
            times.append((time.perf_counter() - start) * 1e3)
        return {"load_ms": host.load_ms or 0.0, "warmup_ms": host.warmup_ms, "first_ms": times[0],
                "p50_ms": statistics.median(times[1:]), "backend": host.backend}
    finally:
        host.unload()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repository", default="engines")
    parser.add_argument("--models", default="tiny_cnn,resnet18,ocr_cls")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--backend", default="onnxruntime", choices=get_args(Backend))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    os.environ.setdefault("ORT_INTRA_OP_THREADS", "1")
    from deployments.runtime.contract.repository import ModelRepository

    names = args.models.split(",")
    repo = ModelRepository(args.repository, names)
    rng = np.random.default_rng(0)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {n: {"none": [], "warmup": []} for n in names}
    for round_ in range(args.rounds):
        for name in names:
            for warm in ((False, True) if round_ % 2 == 0 else (True, False)):
                load = one_load(repo.get(name), warm, args.requests, rng, args.backend)
                runs[name]["warmup" if warm else "none"].append(load)
    rows = []
    for name in names:
        for variant, loads in runs[name].items():
            first = statistics.median(r["first_ms"] for r in loads)
            p50 = statistics.median(r["p50_ms"] for r in loads)
            rows.append({"model": name, "warmup": variant, "first_ms": first, "p50_ms": p50, "ratio": first / p50,
                         "load_ms": statistics.median(r["load_ms"] for r in loads),
                         "warmup_ms": statistics.median(r["warmup_ms"] for r in loads), "loads": loads})
    print("| model | backend | warmup | first request ms | steady p50 ms | first / p50 | load ms | warmup ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        backends = ",".join(sorted({load["backend"] for load in r["loads"]}))
        print(f"| {r['model']} | {backends} | {r['warmup']} | {r['first_ms']:.1f} | {r['p50_ms']:.1f} | "
              f"{r['ratio']:.2f} | {r['load_ms']:.0f} | {r['warmup_ms']:.0f} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "warmup.json").write_text(json.dumps({"args": {**vars(args), "out": str(args.out)}, "rows": rows},
                                                     indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
