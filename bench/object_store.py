"""Models from object storage, measured without Ray: time to first answer of a cold model read
from a real S3 server (SeaweedFS on loopback, ``tests/seaweed.py``) against from local disk,
and the node cache's hit rate under model-control churn.

    .venv/bin/python -m bench.object_store [--models tiny_cnn mid_cnn resnet18] [--rounds 20]

Cold from the store: an empty node cache; ``ModelRepository(url).get(m)`` (list, download,
complete), ``ModelHost.load`` (ONNX Runtime session, warm-up), one inference. From disk: the
same over ``engines/``. Churn: ``--rounds`` loads and unloads of a random model among
``--models`` (seeded) in a cache bound that holds about two of them: each load is a
``peek`` pinning its version (a hit, or a download that may evict), each unload a release.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

import numpy as np

from deployments.runtime.contract.repository import ModelRepository
from deployments.runtime.residency.host import ModelHost
from tests.seaweed import SeaweedFS

ENGINES = Path(__file__).resolve().parents[1] / "engines"


def first_answer_s(repo_root: str | Path, name: str) -> float:
    start = time.perf_counter()
    entry = ModelRepository(repo_root, [name], node="bench").get(name)
    host = ModelHost(entry, "onnxruntime").load()
    spec = entry.config.inputs[0]
    shape = [d if d > 0 else 1 for d in spec.profile.min] if spec.profile else [1, *spec.dims[1:]]
    host.infer({spec.name: np.zeros(shape, np.float32)})
    elapsed = time.perf_counter() - start
    host.unload()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny_cnn", "mid_cnn", "resnet18"])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = SeaweedFS(Path(tmp) / "weed").start()
        try:
            os.environ.update(store.env)
            for name in args.models:
                store.upload(ENGINES / name, f"bench/{name}")
            url = "s3://models/bench"
            rows = []
            for name in args.models:
                os.environ["TRT_SERVE_CACHE_DIR"] = str(Path(tmp) / f"cold-{name}")
                from_store = first_answer_s(url, name)
                from_disk = first_answer_s(ENGINES, name)
                rows.append({"model": name, "bytes": (ENGINES / name / "1/model.onnx").stat().st_size,
                             "store_s": round(from_store, 3), "disk_s": round(from_disk, 3)})
            sizes = sorted(r["bytes"] for r in rows)
            os.environ["TRT_SERVE_CACHE_DIR"] = str(Path(tmp) / "churn")
            os.environ["TRT_SERVE_CACHE_MAX_BYTES"] = str(sizes[-1] + sizes[-2] + 4096)
            rng = random.Random(0)
            loaded: set[str] = set()
            repo = ModelRepository(url, [args.models[0]], node="churn", keep_files=True)
            repo.release(args.models[0])
            for _ in range(args.rounds):
                name = rng.choice(args.models)
                if name in loaded:
                    repo.release(name)
                    loaded.discard(name)
                    continue
                for other in list(loaded):  # one model loaded at a time: the rest may be evicted
                    repo.release(other)
                    loaded.discard(other)
                repo.take(repo.peek(name))
                loaded.add(name)
            stats = repo.store.cache.stats()
            rate = stats["hits"] / max(1, stats["hits"] + stats["downloads"])
            print(json.dumps({"first_answer": rows, "churn": {**stats, "rounds": args.rounds,
                                                              "max_bytes": int(os.environ["TRT_SERVE_CACHE_MAX_BYTES"]),
                                                              "hit_rate": round(rate, 3)}}, indent=1))
        finally:
            store.stop()


if __name__ == "__main__":
    main()
