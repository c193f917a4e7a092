"""The CPU of one hand-off to a context's own thread and back (``ModelHost.call``), work excluded.

A request whose contexts run on threads of their own (ONNX Runtime CUDA with graphs) goes from
the replica's event loop to its context's thread and comes back with the answer: that hop is on
every such request's path. Here ``simple`` (ONNX Runtime CPU) gets a ``ContextThread`` per
context, as the CUDA contexts have, and ``ModelHost.call`` runs a function that does nothing,
``--calls`` times, ``--concurrency`` at a time, on uvloop (Serve's loop): the process's CPU per
call is the hop's cost.

    python -m bench.context_hop --concurrency 1,16 --calls 20000
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


def measure(root: Path, concurrencies: list[int], calls: int) -> list[dict]:
    sys.path.insert(0, str(root))
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

    OnnxRuntimeEngine.create_context = with_thread  # type: ignore[method-assign]
    host = ModelHost(ModelRepository(ROOT / "engines").get("simple"), backend="onnxruntime").load()
    assert host.threaded(), "the contexts did not get threads"

    def nothing() -> int:
        return 1

    async def run(concurrency: int, n: int) -> tuple[float, float]:
        slots = asyncio.Semaphore(concurrency)

        async def one() -> int:
            async with slots:
                return await host.call(nothing)

        cpu, wall = time.process_time(), time.perf_counter()
        answered = sum(await asyncio.gather(*(one() for _ in range(n))))
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        assert answered == n, f"{answered} of {n} calls answered"
        return cpu, wall

    results = []
    for concurrency in concurrencies:
        uvloop.run(run(concurrency, min(calls, 2000)))  # warm-up
        cpu, wall = uvloop.run(run(concurrency, calls))
        results.append({"root": str(root), "concurrency": concurrency, "calls": calls,
                        "cpu_us_per_call": round(cpu / calls * 1e6, 1), "calls_per_s": round(calls / wall)})
    host.unload()
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, default=ROOT, help="the checkout whose deployments/ is measured")
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--calls", type=int, default=20000)
    args = p.parse_args(argv)
    for row in measure(args.root.resolve(), [int(c) for c in args.concurrency.split(",")], args.calls):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
