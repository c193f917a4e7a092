"""Metrics on vs off in one run: does recording the series cost throughput?

One Ray cluster in Ray's fast configuration (HAProxy ingress, throughput-optimized; what
``make serve`` runs) serves two copies of the application side by side: ``/on`` with metrics
(the default) and ``/off`` with ``metrics: {enabled: false}``. Both serve the same models from
the same repository, each with its own replicas. Rounds alternate on, off, on, off... at a fixed
closed-loop concurrency with binary tensors (``bench.loadgen``); the table gives each round's
QPS and the median ratio on / off, and the CPU time the application's replica processes spent
per request (``/proc/<pid>/stat`` utime + stime of every ``ServeReplica:<app>:*`` process over
the round, divided by the requests of warm-up and window): on a machine shared with other
work, wall-clock QPS is noisy, CPU per request much less so. Results go to ``--out``
(``metrics-overhead-<time>.json``).

    python -m bench.metrics_overhead                       # ocr_cls and tiny_cnn, 4 rounds of 8 s
    python -m bench.metrics_overhead --models ocr_cls --rounds 6 --concurrency 16
    python -m bench.metrics_overhead --recording-only      # CPU of the recording path alone, no Ray
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from bench.loadgen import make_workload, run
from bench.throughput import ROOT, SHAPES, _stop_leftovers, _wait_ready, free_port, ray_env


def replica_cpu_s(app: str) -> float:
    """CPU seconds (user + system) used so far by the Serve replica processes of ``app`` (Ray
    titles them ``ray::ServeReplica:<app>:<deployment>``)."""
    marker, total = f"ServeReplica:{app}:".encode(), 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if marker not in (proc / "cmdline").read_bytes():
                continue
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / os.sysconf("SC_CLK_TCK")


def recording_cost_us(requests: int = 20000) -> float:
    """Microseconds of one process's CPU per request for the whole recording path (router:
    success, durations, histogram, last inference; replica: pending, queue, infer, execution
    and batch series), into a scratch metrics directory."""
    scratch = tempfile.mkdtemp(prefix="bench-metrics-files-")
    os.environ["TRT_SERVE_METRICS_DIR"] = scratch
    from deployments.observe import metrics as m

    router, replica = m.RouterRecorder(), m.ReplicaRecorder()
    start = time.process_time()
    for _ in range(requests):
        timing = m.RequestTiming(time.perf_counter())
        with replica.request("tiny_cnn", 1):
            replica.on_execution("tiny_cnn", 1, 1, 1e-4)
        router.finished("tiny_cnn", "1", 200, timing)
    cost = (time.process_time() - start) / requests * 1e6
    shutil.rmtree(scratch, ignore_errors=True)
    return cost


def main(argv: Sequence[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="ocr_cls,tiny_cnn")
    p.add_argument("--rounds", type=int, default=4, help="rounds per side")
    p.add_argument("--duration-s", type=float, default=8.0)
    p.add_argument("--warmup-s", type=float, default=2.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--processes", type=int, default=1, help="load generator processes")
    p.add_argument("--ray-config", default="fast")
    p.add_argument("--deploy-order", default="on,off", choices=["on,off", "off,on"])
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--recording-only", action="store_true", help="only the recording path's CPU per request")
    a = p.parse_args(argv)
    if a.recording_only:
        print(f"recording path: {recording_cost_us():.1f} us of CPU per request")
        return
    models = a.models.split(",")
    os.environ["ORT_INTRA_OP_THREADS"] = "1"
    scratch = Path(tempfile.mkdtemp(prefix="bench-metrics-"))
    os.environ.update(ray_env(a.ray_config, scratch))
    import ray
    from ray import serve

    from deployments.app import build_app

    port = free_port()
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"ORT_INTRA_OP_THREADS": "1"}})
    rows: list[dict] = []
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        base = f"http://127.0.0.1:{port}"
        common = {"repository": str(ROOT / "engines"), "models": models,
                  "router": {"num_cpus": 0.1, "max_ongoing_requests": 1024}}
        sides = {"on": {"port": free_port()}, "off": {"enabled": False}}
        for side in a.deploy_order.split(","):  # which starts first may matter: --deploy-order
            serve.run(build_app({**common, "metrics": sides[side]}), name=side, route_prefix=f"/{side}")
        for side in ("on", "off"):
            _wait_ready(f"{base}/{side}/v2/health/ready")
        rng = np.random.default_rng(0)
        for model in models:
            x = rng.random(SHAPES[model], dtype=np.float32)
            name = "x" if model.startswith("ocr") else "input"
            for r in range(a.rounds):
                for side in ("on", "off") if r % 2 == 0 else ("off", "on"):
                    w = make_workload(f"{side}:{model}", f"{base}/{side}", model, name, x, binary=True)
                    cpu_before = replica_cpu_s(side)
                    [res] = run([(w, a.concurrency)], a.duration_s, a.warmup_s, a.processes)
                    # Requests during warm-up and window, at the window's rate.
                    served = res.qps * (a.warmup_s + a.duration_s)
                    cpu_ms = (replica_cpu_s(side) - cpu_before) * 1e3 / max(served, 1)
                    rows.append({"model": model, "side": side, "round": r, "qps": res.qps,
                                 "p50_ms": res.p50_ms, "p99_ms": res.p99_ms, "errors": res.errors,
                                 "replica_cpu_ms_per_request": cpu_ms})
                    print(f"{model:10s} round {r} {side:3s} {res.qps:8.1f} QPS  p50 {res.p50_ms:.2f} ms  "
                          f"CPU {cpu_ms:.3f} ms/request  errors {res.errors}", flush=True)
        on_text = __import__("requests").get(f"{base}/on/metrics", timeout=30).text
    finally:
        ray.shutdown()
        _stop_leftovers(scratch)
        shutil.rmtree(scratch, ignore_errors=True)
    summary = {}
    print("\n| model | QPS on (median) | QPS off (median) | on / off | replica CPU ms/request on | off | on / off |\n"
          "|---|---|---|---|---|---|---|")
    for model in models:
        def median(key: str, side: str) -> float:
            return statistics.median(r[key] for r in rows if r["model"] == model and r["side"] == side)

        on, off = median("qps", "on"), median("qps", "off")
        cpu_on, cpu_off = median("replica_cpu_ms_per_request", "on"), median("replica_cpu_ms_per_request", "off")
        summary[model] = {"qps_on": on, "qps_off": off, "ratio": on / off,
                          "cpu_ms_on": cpu_on, "cpu_ms_off": cpu_off, "cpu_ratio": cpu_on / cpu_off}
        print(f"| {model} | {on:.1f} | {off:.1f} | {on / off:.3f} | {cpu_on:.3f} | {cpu_off:.3f} | "
              f"{cpu_on / cpu_off:.3f} |")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"metrics-overhead-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"args": vars(a), "cpu_count": os.cpu_count(), "rounds": rows,
                                "summary": summary}, indent=2))
    print(f"wrote {path}; /on/metrics had {on_text.count(chr(10))} lines", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
