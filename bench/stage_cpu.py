"""BENCHMARK ONLY: the CPU a model replica spends in each stage of a request, for ``bench.replica_cpu``.

Installed in every Ray worker process as Ray's ``worker_process_setup_hook``
(``bench.batch_trace.install`` calls ``install``) when ``BENCH_STAGE_CPU`` names a folder. It wraps,
in that process only, the synchronous steps of the request path with ``time.thread_time()`` (the
calling thread's own CPU: exact whatever else the machine runs, and whichever thread runs the
step), and counts their calls:

- ``decode_body`` (inclusive: header length, join, JSON header, tensors), ``join_body`` and
  ``tensor_from_bytes`` (the tensors' bytes: **decode**; the rest of ``decode_body`` is **header**);
- ``validate_request`` (**validate**), ``ModelHost.run`` (**model**: the engine call, its context
  checkout and the model file's graph checks);
- ``encode_response``, ``apply_classification``, ``parameters_of`` (**encode**);
- the router observer's ``finished`` and ``add_phases``, the replica recorder's ``request`` and
  ``on_execution`` (**metrics**, their own calls; the context manager's enter and exit are not);
- the echo's ``response_for`` (its answer; counts the echo's requests);
- the cycle collector's runs (``gc.callbacks``: **gc**), wherever they fall (one that runs
  inside a stage above counts as gc only).

What no wrapper covers (uvicorn, Starlette, Serve's ingress, the event loop, the thread hop,
reading the body and writing the answer, Ray's C++ threads) is the process's CPU from /proc less
these. Every 0.25 s each process writes its totals, ``{key: [calls, cpu_s]}``, to
``<folder>/<pid>.json``.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

ENV = "BENCH_STAGE_CPU"
_totals: dict[str, list[float]] = {}
_lock = threading.Lock()
_collections = threading.local()  # this thread's collections: start_s of the one running, cpu_s in all


def _timed(key: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start, collected = time.thread_time(), getattr(_collections, "cpu_s", 0.0)
        try:
            return fn(*args, **kwargs)
        finally:  # a collection that ran inside counts as gc, not as this stage
            spent = time.thread_time() - start - (getattr(_collections, "cpu_s", 0.0) - collected)
            with _lock:
                cell = _totals.setdefault(key, [0, 0.0])
                cell[0] += 1
                cell[1] += spent

    return wrapper


def _wrap(module: Any, attr: str, key: str) -> None:
    setattr(module, attr, _timed(key, getattr(module, attr)))


def install() -> None:
    """Ray ``worker_process_setup_hook`` part: wrap the stages when ``BENCH_STAGE_CPU`` is set."""
    folder = os.environ.get(ENV)
    if not folder:
        return
    from deployments import routes
    from deployments.observe import metrics, router
    from deployments.protocol import answer, binary
    from deployments.runtime.residency import host

    _wrap(answer, "decode_body", "decode_body")
    _wrap(binary, "join_body", "join")
    _wrap(binary, "tensor_from_bytes", "tensor")
    _wrap(host, "validate_request", "validate")
    _wrap(host.ModelHost, "run", "model")
    for attr in ("encode_response", "apply_classification", "parameters_of"):
        _wrap(answer, attr, "encode")
    _wrap(router.RouterObserver, "finished", "metrics")
    _wrap(routes, "add_phases", "metrics")
    _wrap(metrics.ReplicaRecorder, "request", "metrics")
    _wrap(metrics.ReplicaRecorder, "on_execution", "metrics")
    try:
        from bench import echo
    except ImportError:
        pass
    else:
        _wrap(echo, "response_for", "echo_answer")
    gc.callbacks.append(_collection)
    path = Path(folder) / f"{os.getpid()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    threading.Thread(target=_write_forever, args=(path,), daemon=True).start()


def _collection(phase: str, info: dict[str, Any]) -> None:
    """``gc.callbacks`` entry: the thread CPU of each collection, as the stage ``gc``."""
    if phase == "start":
        _collections.start_s = time.thread_time()
        return
    start = getattr(_collections, "start_s", None)
    if start is None:  # installed while a collection ran
        return
    spent = time.thread_time() - start
    _collections.cpu_s = getattr(_collections, "cpu_s", 0.0) + spent
    with _lock:
        cell = _totals.setdefault("gc", [0, 0.0])
        cell[0] += 1
        cell[1] += spent


def _write_forever(path: Path) -> None:
    while True:
        time.sleep(0.25)
        with _lock:
            text = json.dumps(_totals)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(path)


def read(folder: Path, pids: list[int]) -> dict[str, list[float]]:
    """The totals of ``pids`` summed (``{key: [calls, cpu_s]}``; {} for a process with none yet)."""
    out: dict[str, list[float]] = {}
    for pid in pids:
        try:
            totals = json.loads((folder / f"{pid}.json").read_text())
        except (OSError, ValueError):
            continue
        for key, (calls, cpu_s) in totals.items():
            cell = out.setdefault(key, [0, 0.0])
            cell[0] += calls
            cell[1] += cpu_s
    return out


def stages_us(before: dict[str, list[float]], after: dict[str, list[float]], requests: int) -> dict[str, float]:
    """µs of CPU per request by stage between two ``read``s over ``requests`` requests."""
    def spent(key: str) -> float:
        return after.get(key, [0, 0.0])[1] - before.get(key, [0, 0.0])[1]

    decode = spent("join") + spent("tensor")
    per = {"header": spent("decode_body") - decode, "decode": decode, "validate": spent("validate"),
           "model": spent("model"), "encode": spent("encode") + spent("echo_answer"), "metrics": spent("metrics"), "gc": spent("gc")}
    return {k: round(v * 1e6 / requests, 1) for k, v in per.items() if v > 0}


def calls(before: dict[str, list[float]], after: dict[str, list[float]], key: str) -> int:
    return int(after.get(key, [0, 0.0])[0] - before.get(key, [0, 0.0])[0])
