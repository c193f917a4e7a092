"""The CPU of one hand-off to a context's own thread and back (``ModelHost.call``), work excluded.

A request that does not run inline goes from the replica's event loop to its context's thread
and comes back with the answer: that hop is on every such request's path. Here ``simple`` (ONNX
Runtime CPU) is loaded and ``ModelHost.call`` runs, ``--calls`` times, ``--concurrency`` at a
time, on uvloop (Serve's loop), a function that does nothing (``--work nothing``: the process's
CPU per call is the hop's cost) or the model's own run on one request (``--work run``: what a
request of a short model costs beside its run). ``--threads given`` gives every context a
``ContextThread`` as the CUDA contexts with graphs have one; ``as-loaded`` takes the contexts as
the host loads them (the code under ``--root`` decides: before every context had a thread of its
own, a CPU context's calls went through ``asyncio.to_thread``).

    python -m bench.context_hop --concurrency 1,16 --calls 20000
    python -m bench.context_hop --work run --threads as-loaded --calls 8000
    python -m bench.context_hop --root /tmp/old   # another checkout's deployments/ (git worktree add /tmp/old REV)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure(root: Path, concurrencies: list[int], calls: int, work: str = "nothing",
            threads: str = "given") -> list[dict]:
    sys.path.insert(0, str(root))
    import numpy as np
    import uvloop

    try:
        from deployments.runtime.backends.context_thread import ContextThread
    except ImportError:  # before it had a module of its own
        from deployments.runtime.backends.onnxruntime_cuda import ContextThread  # type: ignore[attr-defined,no-redef]
    from deployments.runtime.backends.onnxruntime import OnnxRuntimeEngine
    from deployments.runtime.contract.repository import ModelRepository
    from deployments.runtime.residency.host import ModelHost

    create = OnnxRuntimeEngine.create_context

    def with_thread(engine):
        context = create(engine)
        context.thread = ContextThread("context-hop")
        return context

    if threads == "given":
        OnnxRuntimeEngine.create_context = with_thread  # type: ignore[method-assign]
    host = ModelHost(ModelRepository(ROOT / "engines").get("simple"), backend="onnxruntime").load()
    assert threads != "given" or host.threaded(), "the contexts did not get threads"
    pair = {"INPUT0": np.arange(16, dtype=np.int32).reshape(1, 16), "INPUT1": np.ones((1, 16), np.int32)}

    def nothing() -> int:
        return 1

    def run_once() -> int:
        out = host.run(pair)
        assert (out["OUTPUT0"] == pair["INPUT0"] + 1).all()  # the answer, checked
        return 1

    fn = nothing if work == "nothing" else run_once

    async def run(concurrency: int, n: int) -> tuple[float, float]:
        slots = asyncio.Semaphore(concurrency)

        async def one() -> int:
            async with slots:
                return await host.call(fn)

        cpu, wall = time.process_time(), time.perf_counter()
        answered = sum(await asyncio.gather(*(one() for _ in range(n))))
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        assert answered == n, f"{answered} of {n} calls answered"
        return cpu, wall

    results = []
    for concurrency in concurrencies:
        uvloop.run(run(concurrency, min(calls, 2000)))  # warm-up
        cpu, wall = uvloop.run(run(concurrency, calls))
        results.append({"root": str(root), "work": work, "threads": threads, "concurrency": concurrency, "calls": calls,
                        "cpu_us_per_call": round(cpu / calls * 1e6, 1), "calls_per_s": round(calls / wall)})
    host.unload()
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, default=ROOT, help="the checkout whose deployments/ is measured")
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--work", choices=("nothing", "run"), default="nothing")
    p.add_argument("--threads", choices=("given", "as-loaded"), default="given")
    args = p.parse_args(argv)
    for row in measure(args.root.resolve(), [int(c) for c in args.concurrency.split(",")], args.calls,
                       args.work, args.threads):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
