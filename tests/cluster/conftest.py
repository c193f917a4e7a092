"""A multi-node Ray cluster on this machine, with logical GPUs, for placement and scaling tests.

``ray.cluster_utils.Cluster`` starts one raylet per "node" in this process's session; each node
carries the logical resources it is given (``num_gpus=1`` makes a GPU node without a GPU: Ray
only counts the resource and sets ``CUDA_VISIBLE_DEVICES``; ONNX Runtime runs on the CPU).

Isolation from other Ray users of this machine (other test sessions run at the same time):
- every Ray process binds to 127.0.0.1 on ports the OS picks (no 6379, 8265 or 8000);
- ``RAY_TMPDIR`` is a private folder, so the cluster's address file does not replace the one
  that a plain ``ray.init()`` elsewhere on the machine would read;
- teardown shuts down only this cluster (``ray.shutdown`` + ``Cluster.shutdown``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import requests

ROOT = Path(__file__).resolve().parents[2]
TINY_CNN_ONNX = ROOT / "engines" / "tiny_cnn" / "1" / "model.onnx"
LOOPBACK = "127.0.0.1"
# Ray Serve reports a replica waiting for resources in the deployment's status message after
# this many seconds (default 30); read by the Serve controller when it starts.
SLOW_STARTUP_WARNING_S = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


# Test models -------------------------------------------------------------------------------

TINY_CNN_CONFIG = """
max_batch_size: 1
instances: 1
inputs:
  - {name: input, datatype: FP32, dims: [-1, 3, 224, 224],
     profile: {min: [1, 3, 224, 224], opt: [1, 3, 224, 224], max: [1, 3, 224, 224]}}
outputs:
  - {name: logits, datatype: FP32, dims: [-1, 1000]}
"""

# A CPU-heavy model with a small request: 3x32x32 in (12 KB of JSON zeros), six 32-channel 3x3
# convolutions at 64x64 (about 0.23 GMAC, tens of ms on one thread). Its replicas, not the
# router's JSON decoding, are the bottleneck, so ongoing requests pile up at the model.
BUSY_CONFIG = """
max_batch_size: 1
instances: 1
inputs:
  - {name: input, datatype: FP32, dims: [-1, 3, 32, 32],
     profile: {min: [1, 3, 32, 32], opt: [1, 3, 32, 32], max: [1, 3, 32, 32]}}
outputs:
  - {name: features, datatype: FP32, dims: [-1, 32]}
"""


def write_busy_onnx(path: Path, layers: int = 6, channels: int = 32) -> None:
    """Write the ``BUSY_CONFIG`` model: (N, 3, 32, 32) FP32 -> (N, 32) FP32."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Resize", ["input", "", "scales"], ["x0"], mode="nearest")]
    inits = [numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")]
    prev, cin = "x0", 3
    for i in range(layers):
        w = (rng.standard_normal((channels, cin, 3, 3)) * 0.1).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        nodes.append(helper.make_node("Conv", [prev, f"w{i}"], [f"c{i}"], pads=[1, 1, 1, 1]))
        nodes.append(helper.make_node("Relu", [f"c{i}"], [f"r{i}"]))
        prev, cin = f"r{i}", channels
    nodes.append(helper.make_node("GlobalAveragePool", [prev], ["pooled"]))
    nodes.append(helper.make_node("Flatten", ["pooled"], ["features"]))
    graph = helper.make_graph(
        nodes, "busy",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, 32, 32])],
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["N", channels])],
        inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


def add_model(repository: Path, name: str, config: str, deployment: dict[str, Any],
              onnx_file: Path | None = None) -> None:
    """Write ``repository/name``: ``config`` plus a ``deployment:`` section, and version 1's ONNX
    file (a copy of ``onnx_file``, else the busy model)."""
    folder = repository / name
    (folder / "1").mkdir(parents=True)
    if onnx_file is None:
        write_busy_onnx(folder / "1" / "model.onnx")
    else:
        shutil.copy(onnx_file, folder / "1" / "model.onnx")
    (folder / "config.yaml").write_text(config + "deployment: " + json.dumps(deployment) + "\n")


def infer_body(shape: tuple[int, ...]) -> bytes:
    """A KServe v2 JSON request of zeros for the single FP32 input named ``input``."""
    count = 1
    for d in shape:
        count *= d
    return json.dumps({"inputs": [{"name": "input", "shape": list(shape), "datatype": "FP32",
                                   "data": [0.0] * count}]}).encode()


TINY_BODY = infer_body((1, 3, 224, 224))
BUSY_BODY = infer_body((1, 3, 32, 32))


# The cluster -------------------------------------------------------------------------------

@dataclass
class LocalCluster:
    """The running cluster: Serve's HTTP proxy at ``url``; GPU nodes added on demand."""

    cluster: Any
    url: str
    gpu_nodes: list[Any] = field(default_factory=list)

    def add_gpu_node(self, num_gpus: float = 1) -> Any:
        """Add a node with 2 logical CPUs and ``num_gpus`` logical GPUs; returns Ray's node."""
        node = self.cluster.add_node(num_cpus=2, num_gpus=num_gpus, node_ip_address=LOOPBACK)
        self.gpu_nodes.append(node)
        return node


@pytest.fixture(scope="package")
def ray_cluster(prepared_engines, seaweedfs) -> Iterator[LocalCluster]:
    """A head node (2 logical CPUs, no GPU) and one GPU node (2 CPUs, 1 GPU), Serve on a free port.

    Every node's environment carries the S3 store's endpoint and credentials (``seaweedfs``) and
    a private node cache folder, as a real cluster's nodes would: a raylet and its workers take
    the environment of the process that started them, here this one, before the nodes start.

    Serve's proxy runs on the head node only: every node here shares 127.0.0.1, so proxies on
    every node would fight for one port (``proxy_location: EveryNode`` is checked in the config
    tests instead).
    """
    import ray
    import ray._private.ray_constants as ray_constants
    from ray import serve
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        pytest.skip("this process is already connected to another Ray instance (tests/integration's "
                    "session fixture?): run tests/cluster first or in its own pytest process")
    saved_env = dict(os.environ)
    temp_dir = tempfile.mkdtemp(prefix="rc", dir="/tmp")  # short: Ray's socket paths live here
    os.environ.update({
        "RAY_TMPDIR": temp_dir,
        # Ray resolves "127.0.0.1" in an address to the machine's outward IP unless it is in
        # single-machine mode (this flag; read at import by child processes, patched below for
        # this one): keep every connection on loopback.
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "ORT_INTRA_OP_THREADS": "1",
        "RAY_SERVE_SLOW_STARTUP_WARNING_S": str(SLOW_STARTUP_WARNING_S),
        "RAY_SERVE_SLOW_STARTUP_WARNING_PERIOD_S": str(SLOW_STARTUP_WARNING_S),
        **seaweedfs.env,
        "TRT_SERVE_CACHE_DIR": os.path.join(temp_dir, "model-cache"),
    })
    saved_flag = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "num_gpus": 0, "node_ip_address": LOOPBACK, "include_dashboard": False})
    local = LocalCluster(cluster, "")
    try:
        local.add_gpu_node()
        ray.init(address=cluster.address, log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": LOOPBACK, "port": port}, proxy_location="HeadOnly")
        local.url = f"http://{LOOPBACK}:{port}"
        yield local
    finally:
        try:
            if ray.is_initialized():
                serve.shutdown()
                ray.shutdown()
        finally:
            cluster.shutdown()
            ray_constants.ENABLE_RAY_CLUSTER = saved_flag
            os.environ.clear()
            os.environ.update(saved_env)
            shutil.rmtree(temp_dir, ignore_errors=True)


# Observing Serve -----------------------------------------------------------------------------

def _application(app: str, deployment: str) -> str:
    """The application running ``deployment`` of the server whose router application is ``app``
    (a dedicated model's is ``app.<model>``)."""
    from deployments.client import deployment_application  # imports Ray Serve: not at collection

    return deployment_application(app, deployment)


def replicas(app: str, deployment: str) -> list[dict[str, Any]]:
    """The deployment's replicas as the Serve controller reports them: ``state``, ``node_id``,
    ``actor_name``... (``ReplicaDetails`` in ``ray.serve.schema``)."""
    from ray.serve.context import _get_global_client

    details = _get_global_client().get_serve_details()
    app_details = details["applications"].get(_application(app, deployment))
    if app_details is None or deployment not in app_details["deployments"]:
        return []
    return app_details["deployments"][deployment]["replicas"]


def deployment_details(app: str, deployment: str) -> dict[str, Any]:
    """``DeploymentDetails`` of a deployment (its ``deployment_config`` as Ray holds it)."""
    from ray.serve.context import _get_global_client

    return _get_global_client().get_serve_details()["applications"][_application(app, deployment)][
        "deployments"][deployment]


def running(app: str, deployment: str) -> int:
    """Number of RUNNING replicas of the deployment (``serve.status``)."""
    from ray import serve

    status = serve.status().applications.get(_application(app, deployment))
    if status is None or deployment not in status.deployments:
        return 0
    return status.deployments[deployment].replica_states.get("RUNNING", 0)


def wait_for(condition: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.25) -> Any:
    """Poll ``condition`` until it returns a truthy value; raise ``TimeoutError`` naming ``what``.
    A request of ``condition`` that is refused or times out (a busy machine) counts as not yet."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = condition()
        except requests.RequestException:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:g} s")
        time.sleep(interval_s)


def post(url: str, body: bytes, timeout_s: float = 30.0) -> requests.Response:
    return requests.post(url, data=body, headers={"Content-Type": "application/json"}, timeout=timeout_s)


@dataclass
class Outcome:
    """One request of a load run: HTTP status (or ``None`` for a client-side failure such as
    a timeout), the JSON body's ``error`` if any, and the latency in seconds."""

    status: int | None
    error: str | None
    latency_s: float


class Load:
    """Closed-loop HTTP load: ``threads`` clients POST ``body`` to ``url`` back to back until
    ``stop()`` or ``max_duration_s``; every request has a ``timeout_s`` client timeout.

    Bounded in time and count: at most ``max_requests`` requests in all, to 127.0.0.1 only.
    """

    def __init__(self, url: str, body: bytes, threads: int = 4, timeout_s: float = 30.0,
                 max_duration_s: float = 90.0, max_requests: int = 20_000) -> None:
        assert url.startswith(f"http://{LOOPBACK}:"), url
        self.url, self.body, self.timeout_s = url, body, timeout_s
        self.max_requests = max_requests
        self.deadline = time.monotonic() + max_duration_s
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, daemon=True) for _ in range(threads)]

    def __enter__(self) -> "Load":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def stop(self) -> list[Outcome]:
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout_s + 5)
        return self.outcomes

    def _client(self) -> None:
        with requests.Session() as session:
            while not self._stop.is_set() and time.monotonic() < self.deadline:
                with self._lock:
                    if len(self.outcomes) >= self.max_requests:
                        return
                start = time.monotonic()
                try:
                    r = session.post(self.url, data=self.body, timeout=self.timeout_s,
                                     headers={"Content-Type": "application/json"})
                    error = r.json().get("error") if r.status_code != 200 else None
                    outcome = Outcome(r.status_code, error, time.monotonic() - start)
                except (requests.RequestException, ValueError) as e:
                    outcome = Outcome(None, f"{type(e).__name__}: {e}", time.monotonic() - start)
                with self._lock:
                    self.outcomes.append(outcome)
