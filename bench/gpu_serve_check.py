"""Prove a serve config runs every model replica on the GPU, and that the pool's GPU bytes stay
in its budget while it churns (LRU) through its models.

Starts ``serve run CONFIG`` (Ray's fast paths on), waits for ready, then records:

* every Serve replica process (``ray::ServeReplica:...`` titles, via psutil) and, from NVML, the
  GPU bytes of each pid: a replica that runs a model on the GPU is an NVML compute process;
* ``/v2/memory``: per dedicated model the backend, its reason, ``device: gpu`` and the replica's
  own GPU bytes; the pool's cache status and timeline;
* metadata of each model (platform, backend); the OCR pipeline's text for the real PNG;
* an LRU churn over the pool's models (each request a different model than the last), reading
  the pool's ``/v2/memory`` after every request: ``resident_bytes`` (the accounting) and
  ``gpu_over_baseline_bytes`` of every load/evict event (the replica's own NVML reading less
  its bytes before any model), both against ``memory_budget_mib``.

* with ``--examples DIR`` (a checkout's ``src/python/examples`` of triton-inference-server/client),
  Triton's own example clients run unmodified against it (HTTP on the config's port, gRPC on its
  ``grpc_port``): the CUDA and system shared-memory ones, over HTTP and gRPC, and the plain infer
  ones; each one's exit code and last lines.

    python -m bench.gpu_serve_check --config serve_config.gpu.yaml [--churn 30] [--examples DIR] [--out DIR]

Writes ``gpu-serve-<time>.json`` to ``--out`` and prints a summary.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import yaml

from bench.replicas import interrupt_group

ROOT = Path(__file__).resolve().parents[1]
CLI = "import sys; from {module} import {func}; sys.argv[0] = '{name}'; sys.exit({func}())"
FAST_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
            "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(2**31 - 1)}


def http(url: str, body: bytes | None = None, headers: dict | None = None, timeout: float = 60) -> tuple[int, Any]:
    request = urllib.request.Request(url, data=body, headers=headers or {}, method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def replica_processes() -> list[dict[str, Any]]:
    """Serve replica processes by their Ray titles: ``{"pid", "title"}``."""
    import psutil

    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        title = " ".join(p.info["cmdline"] or [])
        if title.startswith("ray::ServeReplica"):
            out.append({"pid": p.info["pid"], "title": title.split()[0]})
    return out


def tensor_request(name: str, x: np.ndarray) -> bytes:
    return json.dumps({"inputs": [{"name": name, "shape": list(x.shape), "datatype": "FP32",
                                   "data": x.ravel().tolist()}], "outputs": []}).encode()


def main(argv: Sequence[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="serve_config.gpu.yaml")
    p.add_argument("--churn", type=int, default=30, help="pool requests in the LRU churn")
    p.add_argument("--ready-timeout-s", type=float, default=240)
    p.add_argument("--examples", default="", help="Triton's client examples folder: run EXAMPLES against the server")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = p.parse_args(argv)
    from deployments.runtime.backends.gpu_memory import nvml_processes

    config = yaml.safe_load(Path(a.config).read_text())
    app = config["applications"][0]["args"]
    base = f"http://{config['http_options']['host']}:{config['http_options']['port']}"
    budget_mib = app["pool"].get("memory_budget_mib")
    budget = None if budget_mib is None else round(budget_mib * 2**20 / 1e6, 1)  # in MB, as printed
    env = {**os.environ, **FAST_ENV, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    # `serve run` through this interpreter (Ray may be on PYTHONPATH without its console scripts)
    server = subprocess.Popen([sys.executable, "-c", CLI.format(module="ray.serve.scripts", func="cli", name="serve"),
                               "run", a.config], cwd=ROOT, env=env, start_new_session=True)
    result: dict[str, Any] = {"config": a.config, "budget_mb": budget}
    try:
        deadline = time.time() + a.ready_timeout_s
        while time.time() < deadline:
            try:
                if http(f"{base}/v2/health/ready", timeout=5)[0] == 200:
                    break
            except Exception:
                pass
            if server.poll() is not None:
                raise RuntimeError(f"serve run exited with {server.returncode}")
            time.sleep(2)
        else:
            raise RuntimeError("not ready in time")
        result["ready_after_s"] = round(a.ready_timeout_s - (deadline - time.time()), 1)
        if a.examples:
            grpc = f"{config['http_options']['host']}:{app['grpc_port']}"
            result["examples"] = run_examples(Path(a.examples), base.removeprefix("http://"), grpc)
        # the OCR pipeline on the real PNG
        png = base64.b64encode((ROOT / "tests" / "data" / "ocr_sample.png").read_bytes()).decode()
        body = json.dumps({"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES",
                                       "parameters": {"content_type": "base64"}, "data": [png]}],
                           "outputs": [{"name": "text"}]}).encode()
        status, answer = http(f"{base}/v2/models/ocr/infer", body, {"Content-Type": "application/json"})
        result["ocr"] = {"status": status, "text": answer.get("outputs", [{}])[0].get("data", answer)}
        # the LRU churn of the pool (and a first load of each pool model)
        pool_models = [m for m in ("tiny_cnn", "mid_cnn", "resnet18")]
        rng = np.random.default_rng(0)
        churn = []
        for i in range(a.churn):
            model = pool_models[i % len(pool_models)]
            status, _ = http(f"{base}/v2/models/{model}/infer",
                             tensor_request("input", rng.random((1, 3, 224, 224), dtype=np.float32)),
                             {"Content-Type": "application/json"})
            _, memory = http(f"{base}/v2/memory")
            pool = memory.get("pool") if isinstance(memory, dict) else None
            churn.append({"model": model, "status": status,
                          "resident_mb": round(pool["resident_bytes"] / 1e6, 1) if pool else None,
                          "process_gpu_mb": round(pool.get("process_gpu_bytes", 0) / 1e6, 1) if pool else None})
        result["churn"] = churn
        _, memory = http(f"{base}/v2/memory")
        result["memory"] = memory
        result["metadata"] = {m: http(f"{base}/v2/models/{m}")[1] for m in
                              ("ocr_cls", "ocr_det", "ocr_rec", "tiny_cnn", "ocr")}
        # every replica process against NVML's compute processes
        procs = replica_processes()
        nvml = {p["pid"]: p["used_bytes"] for p in nvml_processes()}
        for proc in procs:
            proc["nvml_gpu_mb"] = round(nvml[proc["pid"]] / 1e6, 1) if proc["pid"] in nvml else None
        result["replicas"] = procs
        result["nvml_processes"] = nvml_processes()
        result["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv"],
                                              capture_output=True, text=True).stdout
    finally:
        interrupt_group(server)
        subprocess.run([sys.executable, "-c", CLI.format(module="ray.scripts.scripts", func="main", name="ray"),
                        "stop", "--force"], capture_output=True, env=env)
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"gpu-serve-{time.strftime('%Y%m%d-%H%M%S')}.json"
        path.write_text(json.dumps(result, indent=2, default=str))
        summarize(result)
        print(f"wrote {path}", file=sys.stderr)


# Triton's example clients run against the GPU server: (script, protocol)
EXAMPLES = [("simple_http_cudashm_client.py", "http"), ("simple_grpc_cudashm_client.py", "grpc"),
            ("simple_http_shm_client.py", "http"), ("simple_grpc_shm_client.py", "grpc"),
            ("simple_http_infer_client.py", "http"), ("simple_grpc_infer_client.py", "grpc")]


def run_examples(folder: Path, http_address: str, grpc_address: str) -> list[dict[str, Any]]:
    """Each of ``EXAMPLES`` run unmodified from ``folder``: exit code and the output's last lines."""
    runs = []
    for script, protocol in EXAMPLES:
        url = http_address if protocol == "http" else grpc_address
        try:
            done = subprocess.run([sys.executable, script, "-u", url], cwd=folder, capture_output=True, text=True,
                                  timeout=120)
            runs.append({"example": script, "exit": done.returncode,
                         "tail": (done.stdout + done.stderr).strip().splitlines()[-4:]})
        except subprocess.TimeoutExpired:
            runs.append({"example": script, "exit": None, "tail": ["timed out after 120 s"]})
    return runs


def summarize(result: dict[str, Any]) -> None:
    print("replicas (pid, title, NVML GPU MB):")
    for proc in result.get("replicas", []):
        print(f"  {proc['pid']:>7} {proc['title']:50} {proc['nvml_gpu_mb']}")
    memory = result.get("memory") or {}
    for name, m in (memory.get("dedicated") or {}).items():
        if isinstance(m, dict) and "backend" in m:
            print(f"  {name}: {m['backend']} ({m.get('backend_reason')}), device {m.get('device')}, "
                  f"pid {m.get('pid')}, process GPU {m.get('process_gpu_bytes', 0) / 1e6:.0f} MB ({m.get('gpu_source')})")
    pool = memory.get("pool")
    if pool:
        events = pool.get("events", [])
        over = [e.get("gpu_over_baseline_bytes") for e in events if "gpu_over_baseline_bytes" in e]
        print(f"pool: budget {result['budget_mb']} MB; max resident {max((e['resident_bytes'] for e in events), default=0) / 1e6:.0f} MB; "
              f"max GPU over baseline {max(over, default=0) / 1e6:.0f} MB over {len(over)} events; "
              f"loads {sum(e['event'] in ('load', 'reload') for e in events)}, evictions {sum(e['event'] == 'evict' for e in events)}")
        for name, m in pool.get("models", {}).items():
            print(f"  pool {name}: {m.get('backend')} {m.get('device')} {m.get('bytes', 0) / 1e6:.0f} MB ({m.get('backend_reason')})")
    for run in result.get("examples", []):
        print(f"  example {run['example']}: exit {run['exit']}" + ("" if run["exit"] == 0 else f" {run['tail']}"))
    print("ocr:", result.get("ocr"))
    print("churn statuses:", sorted({c["status"] for c in result.get("churn", [])}))
    for m, md in (result.get("metadata") or {}).items():
        print(f"  metadata {m}: platform {md.get('platform')}, backend {md.get('backend')}")


if __name__ == "__main__":
    main(sys.argv[1:])
