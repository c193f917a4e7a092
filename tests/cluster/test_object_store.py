"""``repository: s3://...`` on a two-node cluster: a model uploaded to the store after the start and
loaded through the API serves from the pool replica on each node, each node downloading it once
into its own node cache (the nodes share one filesystem; the cache is keyed by Ray node id)."""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest
import requests

from .conftest import ROOT, TINY_CNN_CONFIG, TINY_CNN_ONNX, _application, replicas, wait_for

pytestmark = pytest.mark.integration

REQUESTS = 24  # through a handle to the pool: Serve picks either replica for each (both miss: 2**-23)


def _tiny_input() -> np.ndarray:
    return np.random.default_rng(3).standard_normal((1, 3, 224, 224)).astype(np.float32)


def _assert_equal(content: bytes, expected: np.ndarray) -> None:
    got = np.array(json.loads(content)["outputs"][0]["data"], dtype=np.float32).reshape(expected.shape)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def _downloads(base: str) -> dict[str, tuple[int, set[tuple[str, int]]]]:
    """Per node folder of the node cache: (downloads, cached (model, version))."""
    cache = requests.get(f"{base}/v2/memory", timeout=30).json()["model_cache"]
    return {n["node"]: (n["downloads"], {(e["model"], e["version"]) for e in n["entries"]}) for n in cache["nodes"]}


def test_a_model_uploaded_after_the_start_serves_from_every_node_with_one_download_per_node(ray_cluster, seaweedfs):
    import onnxruntime as ort
    from ray import serve

    from deployments.app import delete_server, run_applications
    from deployments.protocol.answer import Answer

    prefix = f"cluster{uuid.uuid4().hex[:6]}"
    seaweedfs.upload(ROOT / "engines" / "simple", f"{prefix}/simple")  # the pool exists from the start
    nodes = {ray_cluster.cluster.head_node.node_id, ray_cluster.gpu_nodes[0].node_id}
    base = f"{ray_cluster.url}/s3c"
    try:
        run_applications({"repository": f"s3://{seaweedfs.bucket}/{prefix}", "model_control_mode": "explicit",
                          "pool": {"num_replicas": 2}}, name="s3c", route_prefix="/s3c")
        pool = wait_for(lambda: (r := [x for x in replicas("s3c", "pool") if x["state"] == "RUNNING"])
                        and len(r) == 2 and r, 60, "two pool replicas running")
        assert {r["node_id"] for r in pool} == nodes, "Serve put both pool replicas on one node"
        before = _downloads(base)

        fs = seaweedfs.filesystem()
        fs.pipe(f"{seaweedfs.bucket}/{prefix}/tiny_cnn/config.yaml",
                (TINY_CNN_CONFIG + "deployment: {mode: pool}\n").encode())
        fs.put_file(str(TINY_CNN_ONNX), f"{seaweedfs.bucket}/{prefix}/tiny_cnn/1/model.onnx")
        r = requests.post(f"{base}/v2/repository/models/tiny_cnn/load", timeout=180)
        assert r.status_code == 200, r.text

        x = _tiny_input()
        expected = ort.InferenceSession(str(TINY_CNN_ONNX), providers=["CPUExecutionProvider"]).run(
            None, {"input": x})[0]
        body = {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}
        r = requests.post(f"{base}/v2/models/tiny_cnn/infer", json=body, timeout=60)  # the front door
        assert r.status_code == 200, r.text
        _assert_equal(r.content, expected)
        # Serve's proxy prefers the replica on its own node: through a handle, as the router and the
        # pipelines call the pool, Serve picks either replica for each request (the key given: no
        # multiplexed-id affinity)
        pool_handle = serve.get_deployment_handle("pool", app_name=_application("s3c", "pool"))
        for _ in range(REQUESTS):
            answer = pool_handle.infer_body.remote("tiny_cnn", "1", True, [json.dumps(body).encode()], None, 60.0,
                                                   "tiny_cnn").result(timeout_s=60)
            assert isinstance(answer, Answer), answer
            _assert_equal(answer.content, expected)

        answered: dict[str, dict] = {}  # node -> a pool replica's memory status there

        def every_node_answered() -> bool:
            status = requests.get(f"{base}/v2/memory", timeout=30).json()["pool"]  # one replica's, at random
            if status["request_rates"].get("tiny_cnn", 0) > 0:
                answered[status["node"]] = status
            return set(answered) == nodes

        wait_for(every_node_answered, 60, "the pool replica on each node reporting tiny_cnn's requests")
        assert all(s["models"]["tiny_cnn"]["state"] == "ready" for s in answered.values())

        after = _downloads(base)
        assert set(after) == nodes
        for node in nodes:
            downloads, cached = after[node]
            assert downloads - before.get(node, (0, set()))[0] == 1, (node, before, after)
            assert ("tiny_cnn", 1) in cached
    finally:
        delete_server("s3c")
