"""Metrics on vs off in one run: what recording the series costs per request, and in throughput.

One Ray cluster in Ray's fast configuration (HAProxy ingress, throughput-optimized; what
``make serve`` runs) serves two copies of the application side by side: ``/on`` with metrics
(the default) and ``/off`` with ``metrics: {enabled: false}``, same models, each with its own
replicas. The models (``--models``): ``tiny_cnn`` (the multiplexed pool), ``ocr_cls``
(dedicated, unbatched as shipped) and ``ocr_cls_batched`` (a copy with a 2 ms dynamic batching
window: the batch scheduler's path).

Three figures, all from this one run:

1. **Throughput, A/B interleaved.** Per model, ``--pairs`` pairs of short rounds at a fixed
   closed-loop concurrency with binary tensors (``bench.loadgen``), in the order on off, off on,
   on off... (ABBA: a drift of the machine's load hits both sides alike). Each pair gives a
   ratio QPS on / QPS off; the table gives the median ratio with its spread (25th-75th
   percentile and min-max over pairs). On a shared machine the spread says what the run can
   resolve: a 3% effect is shown only when the interquartile range is narrower than that.
2. **CPU per request.** The CPU time (``/proc/<pid>/stat`` utime + stime) of the side's Serve
   replica processes (``ray::ServeReplica:<app>:*``: router and model replicas) over the round
   divided by its requests; median of the per-pair ratios on / off as above.
3. **The metrics code's own CPU per request**, measured two ways: (a) the metrics layer alone
   (``recording_cost_us``: the router's and a replica's infer wrappers around no work, metrics
   on minus off, 20,000 times, CPU time), divided by the on side's CPU per request from 2; (b) with ``py-spy`` (if installed),
   one extra on round per model sampled at 250 Hz in every replica process of ``/on``, only
   the thread holding the GIL (``--gil``): the share of those samples spent in
   ``deployments/observe/`` or ``prometheus_client`` code (``is_metrics_sample``). The
   denominator is Python-level CPU only (not ONNX Runtime's or Ray's native work without the
   GIL), so (b) is an upper bound of the share of all CPU.

Results go to ``--out`` (``metrics-overhead-<time>.json``) and a markdown table to stdout.

    python -m bench.metrics_overhead                             # 3 models, 10 pairs of 3 s rounds
    python -m bench.metrics_overhead --models ocr_cls_batched --pairs 20
    python -m bench.metrics_overhead --gpu-fraction 0.1 --processes 4   # on a GPU machine
    python -m bench.metrics_overhead --recording-only            # (a) alone, no Ray (seconds)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from multiprocessing.pool import ThreadPool
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from bench.replicas import cpu_seconds
from bench.loadgen import make_workload, run
from bench.throughput import BATCHED_SUFFIX, ROOT, SHAPES, _stop_leftovers, _wait_ready, free_port, prepare_repository, ray_env

# A sample is the metrics code's when the innermost frame of project or prometheus_client code
# in its stack is one of these files (py-spy's raw format names each frame's file). Innermost,
# because the observe wrappers sit above every request's own handling in the stack.
METRICS_FRAMES = ("deployments/observe/", "prometheus_client/")
OWN_FRAMES = ("deployments/",) + METRICS_FRAMES


# Innermost frames of a thread that waits (py-spy's idle detection misses some of them on a
# busy machine): the metrics flush thread's wait, the node metrics server's select.
WAITING_LEAVES = ("Condition.wait (threading.py", "Event.wait (threading.py", ".select (selectors.py",
                  "sleep (")


def is_waiting(stack: str) -> bool:
    leaf = stack.rsplit(";", 1)[-1]
    return any(part in leaf for part in WAITING_LEAVES)


def is_metrics_sample(stack: str) -> bool:
    """``stack``: py-spy raw, ``outer (file:line);...;inner (file:line)``."""
    for frame in reversed(stack.split(";")):
        where = frame.rpartition("(")[2]
        if any(part in where for part in OWN_FRAMES):
            return any(part in where for part in METRICS_FRAMES)
    return False


def replica_pids(app: str) -> list[int]:
    """Pids of the Serve replica processes of router application ``app`` and its models'
    applications (Ray titles them ``ray::ServeReplica:<app>[.<model>]:<deployment>``)."""
    markers, pids = (f"ServeReplica:{app}:".encode(), f"ServeReplica:{app}.".encode()), []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if any(marker in (proc / "cmdline").read_bytes() for marker in markers):
                    pids.append(int(proc.name))
            except OSError:
                continue
    return pids


def replica_cpu_s(app: str) -> float:
    """CPU seconds (user + system) used so far by the Serve replica processes of ``app``."""
    return sum(map(cpu_seconds, replica_pids(app)))


def _recording_cost_us(requests: int) -> dict[str, float]:
    import asyncio

    scratch = tempfile.mkdtemp(prefix="bench-metrics-files-")
    os.environ["TRT_SERVE_METRICS_DIR"] = scratch
    from starlette.requests import Request
    from starlette.responses import Response

    from deployments.observe import metrics as m
    from deployments.observe.deployment import observe_replica_infer
    from deployments.observe.router import RouterObserver, observe_infer, phase

    response = Response(b"", 200)

    class Router:  # the infer route as deployments.routes has it (every replica's), without the work
        def __init__(self, observer: RouterObserver | None) -> None:
            self.observer = observer

        @observe_infer
        async def infer(self, request: Request) -> Response:
            with phase(request, "compute_input_s"):
                pass
            with phase(request, "compute_output_s"):
                pass
            return response

    class Replica:  # a model replica's infer: one model run reported by the host
        def __init__(self, recorder: m.ReplicaRecorder | None) -> None:
            self.recorder = recorder

        @observe_replica_infer(lambda self: ("tiny_cnn", 1))
        async def infer(self) -> None:
            if self.recorder is not None:
                self.recorder.on_execution("tiny_cnn", 1, 1, 1e-4)

    scope = {"type": "http", "method": "POST", "path": "/v2/models/tiny_cnn/infer", "headers": [],
             "query_string": b"", "path_params": {"name": "tiny_cnn"}}
    router_on, router_off = Router(RouterObserver({"tiny_cnn": "1"})), Router(None)
    replica_on, replica_off = Replica(m.ReplicaRecorder()), Replica(None)
    sides = {"router_on": lambda: router_on.infer(Request(dict(scope))),
             "router_off": lambda: router_off.infer(Request(dict(scope))),
             "replica_on": replica_on.infer, "replica_off": replica_off.infer}

    async def timed(make: Any) -> float:
        start = time.process_time()
        for _ in range(requests):
            await make()
        return (time.process_time() - start) / requests * 1e6

    out = {side: asyncio.run(timed(make)) for side, make in sides.items()}
    m.flush()
    shutil.rmtree(scratch, ignore_errors=True)
    out["total"] = out["router_on"] - out["router_off"] + out["replica_on"] - out["replica_off"]
    return out


def recording_cost_us(requests: int = 20000) -> dict[str, float]:
    """Microseconds of one process's CPU per request of the metrics layer: the router's infer
    route (``observe_infer``, two ``phase`` blocks, the recorder) and a replica's infer
    (``observe_replica_infer``, one execution) with metrics on and off, around no work;
    ``total`` = (router on - off) + (replica on - off). Buffer writes to the file included. In a
    fresh process (so this one does not switch ``prometheus_client`` to multiprocess mode)."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_recording_cost_us, (requests,))


def pyspy() -> str | None:
    """The ``py-spy`` executable (beside this Python, or on PATH), or None."""
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


def metrics_share(exe: str, pids: Sequence[int], duration_s: float, scratch: Path) -> dict[str, float]:
    """Sample ``pids`` with py-spy for ``duration_s`` (non-blocking, 250 Hz, only the thread
    holding the GIL: a thread waiting for the GIL or in a wait py-spy does not see as idle would
    otherwise count as busy on a loaded machine; ``WAITING_LEAVES`` are dropped too): the
    samples, and the share that is metrics code (``is_metrics_sample``) with its most frequent
    innermost frames."""
    procs = []
    for pid in pids:
        out = scratch / f"spy-{pid}.txt"
        procs.append((out, subprocess.Popen(
            [exe, "record", "--pid", str(pid), "--duration", str(max(1, int(duration_s))), "--rate", "250",
             "--nonblocking", "--gil", "--format", "raw", "--output", str(out)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))
    samples: Counter[str] = Counter()
    leaves: Counter[str] = Counter()  # metrics stacks by their innermost frame
    for out, proc in procs:
        proc.wait(timeout=duration_s + 60)
        if not out.exists():
            continue
        for line in out.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if not count.isdigit():
                continue
            if is_waiting(stack):
                samples["waiting"] += int(count)
                continue
            samples["all"] += int(count)
            if is_metrics_sample(stack):
                samples["metrics"] += int(count)
                leaves[stack.rsplit(";", 1)[-1]] += int(count)
    return {"samples": samples["all"], "metrics_samples": samples["metrics"], "waiting_samples": samples["waiting"],
            "metrics_share": samples["metrics"] / max(samples["all"], 1),
            "top_metrics_frames": leaves.most_common(8)}


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, 25th / 75th percentile, min and max of ``values``."""
    p25, p50, p75 = np.percentile(values, [25, 50, 75])
    return {"median": float(p50), "p25": float(p25), "p75": float(p75),
            "min": float(min(values)), "max": float(max(values))}


def input_name(model: str) -> str:
    return "x" if model.startswith("ocr") else "input"


def repository(scratch: Path, models: Sequence[str], gpu_fraction: float) -> Path:
    """The shipped repository's folders (symlinks) plus ``<model>_batched`` copies for the
    ``*_batched`` names in ``models`` (one dedicated replica, 2 ms window)."""
    dest = scratch / "engines"
    dest.mkdir()
    for folder in (ROOT / "engines").iterdir():
        if (folder / "config.yaml").exists():
            (dest / folder.name).symlink_to(folder.resolve())
    batched = [m.removesuffix(BATCHED_SUFFIX) for m in models if m.endswith(BATCHED_SUFFIX)]
    prepare_repository(dest, ROOT / "engines", [], batched, 1, 2.0, gpu_fraction)
    return dest


def app_args(repo: Path, models: Sequence[str], gpu_fraction: float) -> dict[str, Any]:
    """The application args both sides share (``metrics`` apart)."""
    args: dict[str, Any] = {"repository": str(repo), "models": list(models),
                            "router": {"num_replicas": 1, "num_cpus": 0.1, "max_ongoing_requests": 1024}}
    if gpu_fraction:
        args.update(use_gpus=True, pool={"num_gpus": gpu_fraction},
                    deployments={m: {"num_gpus": gpu_fraction} for m in models if m != "tiny_cnn"})
    else:
        args["use_gpus"] = False
    return args


def batch_counts(model: str, side: str) -> tuple[int, int] | None:
    """(requests, model calls) so far of a batched model's replica (``ModelDeployment.batching``;
    one replica), or None (not batched, or the call failed)."""
    if not model.endswith(BATCHED_SUFFIX):
        return None
    try:
        import asyncio

        from ray import serve

        async def ask() -> dict:  # in Ray's throughput-optimized mode a handle needs a running loop
            return await serve.get_deployment_handle(f"model-{model}", app_name=f"{side}.{model}").batching.remote()

        stats = asyncio.run(ask())
        return stats["requests"], sum(stats["calls_by_requests"].values())
    except Exception as e:  # the figure is an explanation, not the measurement
        print(f"batch counters of {model} ({side}) unavailable: {e}", file=sys.stderr)
        return None


def measure(a: argparse.Namespace, base: str, model: str, x: np.ndarray, side: str) -> dict[str, Any]:
    """One round of one side: QPS, latency, replica CPU per request and, for a batched model,
    requests per model call (CPU per request falls as batches grow)."""
    w = make_workload(f"{side}:{model}", f"{base}/{side}", model, input_name(model), x, binary=True)
    batches_before = batch_counts(model, side)
    cpu_before = replica_cpu_s(side)
    [res] = run([(w, a.concurrency)], a.round_s, a.warmup_s, a.processes)
    served = res.qps * (a.warmup_s + a.round_s)  # requests of warm-up and window, at the window's rate
    cpu_us = (replica_cpu_s(side) - cpu_before) * 1e6 / max(served, 1)
    batches_after = batch_counts(model, side)
    per_call = None
    if batches_before and batches_after and batches_after[1] > batches_before[1]:
        per_call = (batches_after[0] - batches_before[0]) / (batches_after[1] - batches_before[1])
    return {"model": model, "side": side, "qps": res.qps, "p50_ms": res.p50_ms, "p99_ms": res.p99_ms,
            "errors": res.errors, "replica_cpu_us_per_request": cpu_us, "requests_per_model_call": per_call}


def summarize(rows: list[dict], model: str, recording_us: float, profile: dict | None) -> dict[str, Any]:
    pairs = sorted({r["pair"] for r in rows if r["model"] == model})
    side = {(r["pair"], r["side"]): r for r in rows if r["model"] == model}
    qps = spread([side[p, "on"]["qps"] / side[p, "off"]["qps"] for p in pairs])
    cpu = spread([side[p, "on"]["replica_cpu_us_per_request"] / side[p, "off"]["replica_cpu_us_per_request"]
                  for p in pairs])
    cpu_on = statistics.median(side[p, "on"]["replica_cpu_us_per_request"] for p in pairs)
    out = {"pairs": len(pairs), "qps_ratio": qps, "cpu_ratio": cpu,
           "qps_on": statistics.median(side[p, "on"]["qps"] for p in pairs),
           "qps_off": statistics.median(side[p, "off"]["qps"] for p in pairs),
           "cpu_us_on": cpu_on,
           "cpu_us_off": statistics.median(side[p, "off"]["replica_cpu_us_per_request"] for p in pairs),
           "recording_us": recording_us, "recording_share": recording_us / cpu_on}
    per_call = {sd: [side[p, sd]["requests_per_model_call"] for p in pairs if side[p, sd]["requests_per_model_call"]]
                for sd in ("on", "off")}
    if per_call["on"] and per_call["off"]:
        out["requests_per_model_call"] = {sd: statistics.median(v) for sd, v in per_call.items()}
    if profile:
        out["profile"] = profile
    return out


def markdown(summary: dict[str, dict]) -> str:
    def r(s: dict) -> str:
        return f"{s['median']:.3f} ({s['p25']:.3f}-{s['p75']:.3f}; {s['min']:.2f}-{s['max']:.2f})"

    lines = ["| model | pairs | QPS on / off: median (p25-p75; min-max) | QPS on | off | "
             "replica CPU us/request on | off | CPU on / off: median (p25-p75; min-max) | "
             "metrics layer us/request (share of on's CPU) | py-spy: metrics share of GIL samples |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for model, s in summary.items():
        spy = s.get("profile")
        spy_text = f"{spy['metrics_share']:.2%} of {spy['samples']}" if spy else "-"
        lines.append(f"| {model} | {s['pairs']} | {r(s['qps_ratio'])} | {s['qps_on']:.1f} | {s['qps_off']:.1f} | "
                     f"{s['cpu_us_on']:.0f} | {s['cpu_us_off']:.0f} | {r(s['cpu_ratio'])} | "
                     f"{s['recording_us']:.1f} ({s['recording_share']:.2%}) | {spy_text} |")
    return "\n".join(lines)


def main(argv: Sequence[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny_cnn,ocr_cls,ocr_cls_batched")
    p.add_argument("--pairs", type=int, default=10, help="pairs of rounds (on + off) per model")
    p.add_argument("--round-s", type=float, default=3.0, help="measured seconds per round")
    p.add_argument("--warmup-s", type=float, default=0.5)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--processes", type=int, default=1, help="load generator processes")
    p.add_argument("--gpu-fraction", type=float, default=0.0, help="num_gpus of each model replica (0: CPU)")
    p.add_argument("--no-profile", action="store_true", help="skip the py-spy round")
    p.add_argument("--ray-config", default="fast")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--recording-only", action="store_true", help="only the recording path's CPU per request")
    a = p.parse_args(argv)
    cost = recording_cost_us()
    recording_us = cost["total"]
    print(f"metrics layer: {recording_us:.1f} us of CPU per request (router {cost['router_on']:.1f} on / "
          f"{cost['router_off']:.1f} off, replica {cost['replica_on']:.1f} / {cost['replica_off']:.1f} us)", flush=True)
    if a.recording_only:
        return
    models = a.models.split(",")
    os.environ.setdefault("ORT_INTRA_OP_THREADS", "1")
    scratch = Path(tempfile.mkdtemp(prefix="bench-metrics-"))
    os.environ.update(ray_env(a.ray_config, scratch))
    import ray
    from ray import serve

    from deployments.app import run_applications

    repo = repository(scratch, models, a.gpu_fraction)
    port = free_port()
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"ORT_INTRA_OP_THREADS": os.environ["ORT_INTRA_OP_THREADS"]}})
    rows: list[dict] = []
    profiles: dict[str, dict] = {}
    exe = None if a.no_profile else pyspy()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        base = f"http://127.0.0.1:{port}"
        common = app_args(repo, models, a.gpu_fraction)
        for side, metrics in (("on", {"port": free_port()}), ("off", {"enabled": False})):
            run_applications({**common, "metrics": metrics}, name=side, route_prefix=f"/{side}")
        for side in ("on", "off"):
            _wait_ready(f"{base}/{side}/v2/health/ready")
        rng = np.random.default_rng(0)
        for model in models:
            x = rng.random(SHAPES[model.removesuffix(BATCHED_SUFFIX)], dtype=np.float32)
            for side in ("on", "off"):  # first requests (pool loads, batch queue start) off the record
                measure(a, base, model, x, side)
            for pair in range(a.pairs):
                for side in ("on", "off") if pair % 2 == 0 else ("off", "on"):
                    row = {"pair": pair, **measure(a, base, model, x, side)}
                    rows.append(row)
                    batch = row["requests_per_model_call"]
                    print(f"{model:16s} pair {pair:2d} {side:3s} {row['qps']:8.1f} QPS  p50 {row['p50_ms']:.2f} ms  "
                          f"CPU {row['replica_cpu_us_per_request']:.0f} us/request  errors {row['errors']}"
                          + (f"  {batch:.2f} requests/model call" if batch else ""), flush=True)
            if exe:
                w = make_workload(f"on:{model}", f"{base}/on", model, input_name(model), x, binary=True)
                pids = replica_pids("on")
                with ThreadPool(1) as spy:
                    sampled = spy.apply_async(metrics_share, (exe, pids, a.round_s, scratch))
                    run([(w, a.concurrency)], a.round_s + 1.0, a.warmup_s, a.processes)
                    profiles[model] = sampled.get()
                print(f"{model:16s} py-spy: metrics code in {profiles[model]['metrics_share']:.2%} of "
                      f"{profiles[model]['samples']} samples", flush=True)
        on_text = __import__("requests").get(f"{base}/on/metrics", timeout=30).text
    finally:
        ray.shutdown()
        _stop_leftovers(scratch)
        shutil.rmtree(scratch, ignore_errors=True)
    summary = {m: summarize(rows, m, recording_us, profiles.get(m)) for m in models}
    print("\n" + markdown(summary))
    for model, s in summary.items():
        if "requests_per_model_call" in s:
            print(f"{model}: requests per model call, median over rounds: on {s['requests_per_model_call']['on']:.2f}, "
                  f"off {s['requests_per_model_call']['off']:.2f}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"metrics-overhead-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"args": vars(a), "cpu_count": os.cpu_count(), "rounds": rows,
                                "summary": summary}, indent=2))
    print(f"wrote {path}; /on/metrics had {on_text.count(chr(10))} lines", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
