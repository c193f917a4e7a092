"""Dynamic batching over real HTTP: concurrent requests share model calls, each keeps its own answer.

A second application ("batching", under /batching) serves copies of ocr_cls and ocr_rec with a
wide batching window (``max_queue_delay_ms: 500``), so requests that arrive while the model is
busy land in one batch, ``ocr_cls_padded``, batches padded to preferred sizes 4 and 8 (forced:
on CPU ``auto`` does not pad), and ``encoder``, all-MiniLM-L6-v2 with sequence buckets (forced too); the
replica's own counters (``ModelDeployment.batching``) say what it ran.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import requests
import yaml

from .conftest import REPOSITORY, application, deployment_calls, send_together

pytestmark = pytest.mark.integration

MODELS = ("ocr_cls", "ocr_rec")
ENCODER = "all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def batching_server(serve_instance, tmp_path_factory):
    """The app over a repository of ocr_cls and ocr_rec with a 500 ms batching window."""
    root = tmp_path_factory.mktemp("batching-repo")
    padded = {"preferred_batch_size": [4, 8], "pad_to_preferred": True}
    buckets = {"sequence_buckets": [16, 32, 64], "pad_to_preferred": True}  # buckets on the CPU too
    for name, base, extra in [(m, m, {}) for m in MODELS] + [("ocr_cls_padded", "ocr_cls", padded),
                                                             ("encoder", ENCODER, buckets)]:
        raw = yaml.safe_load((Path(REPOSITORY) / base / "config.yaml").read_text())
        raw["dynamic_batching"] = {"max_queue_delay_ms": 500, **extra}
        raw["deployment"] = {"mode": "dedicated", "max_ongoing_requests": 32}
        (root / name).mkdir()
        (root / name / "config.yaml").write_text(yaml.safe_dump(raw))
        (root / name / "1").symlink_to(Path(REPOSITORY) / base / "1")
    with application(serve_instance, {"repository": str(root)}, "batching") as url:
        yield url


@pytest.fixture(scope="module")
def counters(batching_server):
    """``counters(model)``: the replica's batch counters (``ModelDeployment.batching``)."""
    with deployment_calls() as call:
        yield lambda model: call(f"batching.{model}", f"model-{model}", "batching")


def reference(model: str, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(f"{REPOSITORY}/{model}/1/model.onnx", providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def post(url: str, model: str, request_id: str, x: np.ndarray, binary: bool) -> requests.Response:
    """JSON or binary (request and response) infer of one FP32 input ``x``."""
    tensor = {"name": "x", "shape": list(x.shape), "datatype": "FP32"}
    if not binary:
        body = {"id": request_id, "inputs": [{**tensor, "data": x.ravel().tolist()}]}
        return requests.post(f"{url}/v2/models/{model}/infer", json=body, timeout=120)
    head = json.dumps({"id": request_id, "inputs": [{**tensor, "parameters": {"binary_data_size": x.nbytes}}],
                       "parameters": {"binary_data_output": True}}).encode()
    return requests.post(f"{url}/v2/models/{model}/infer", data=head + x.tobytes(), timeout=120,
                         headers={"Inference-Header-Content-Length": str(len(head))})


def output(response: requests.Response) -> tuple[str, np.ndarray]:
    """(id, first output) of a JSON or binary response."""
    assert response.status_code == 200, response.text
    length = response.headers.get("Inference-Header-Content-Length")
    header = json.loads(response.content if length is None else response.content[:int(length)])
    (tensor,) = header["outputs"]
    if length is None:
        data = np.array(tensor["data"], np.float32)
    else:
        data = np.frombuffer(response.content[int(length):], np.float32)
    return header["id"], data.reshape(tensor["shape"])




def test_concurrent_requests_share_a_batch_and_each_gets_its_own_answer(batching_server, counters):
    rng = np.random.default_rng(11)
    inputs = [rng.standard_normal((rows, 3, 48, 192), dtype=np.float32) for rows in (1, 2, 1, 3, 1, 2)]
    bad = np.zeros((1, 3, 48, 100), np.float32)  # width 100: outside ocr_cls's fixed 192
    calls = [lambda i=i, x=x: post(batching_server, "ocr_cls", f"cls-{i}", x, binary=i % 2 == 1)
             for i, x in enumerate(inputs)]
    calls.append(lambda: post(batching_server, "ocr_cls", "cls-bad", bad, binary=False))
    # Requests that arrive while the replica is busy join; on a loaded machine one round's
    # requests can arrive apart, so up to five rounds are sent (each checked) until one joins.
    for _ in range(5):
        before = counters("ocr_cls")
        responses = send_together(calls)
        for i, (x, response) in enumerate(zip(inputs, responses)):
            request_id, got = output(response)
            assert request_id == f"cls-{i}"
            np.testing.assert_allclose(got, reference("ocr_cls", x), rtol=1e-4, atol=1e-5)
        assert responses[-1].status_code == 400 and "axis 3 is 100" in responses[-1].json()["error"]
        after = counters("ocr_cls")
        assert after["enabled"] and after["requests"] - before["requests"] == len(inputs)
        assert after["retried_alone"] == before["retried_alone"]
        if after["max_requests"] > 1:
            break
    assert after["max_requests"] > 1 and after["max_rows"] <= 32


def test_ocr_rec_batches_each_width_apart(batching_server, counters):
    rng = np.random.default_rng(12)
    widths = [160, 320, 160, 320, 160, 320]
    inputs = [rng.standard_normal((1, 3, 48, w), dtype=np.float32) for w in widths]
    for _ in range(5):  # until a round joins (see the test above)
        responses = send_together([lambda i=i, x=x: post(batching_server, "ocr_rec", f"rec-{i}", x, binary=True)
                                   for i, x in enumerate(inputs)])
        for i, (x, response) in enumerate(zip(inputs, responses)):
            request_id, got = output(response)
            assert request_id == f"rec-{i}"
            np.testing.assert_allclose(got, reference("ocr_rec", x), rtol=1e-4, atol=1e-5)
        stats = counters("ocr_rec")
        if stats["max_requests"] > 1:
            break
    # Joined calls happened, and none had to be re-run alone (mixed widths would fail to join).
    assert stats["max_requests"] > 1 and stats["retried_alone"] == 0


def test_padded_batches_answer_each_request_with_its_own_rows_only(batching_server, counters):
    rng = np.random.default_rng(13)
    inputs = [rng.standard_normal((rows, 3, 48, 192), dtype=np.float32) for rows in (1, 2, 1)]
    before = counters("ocr_cls_padded")
    responses = send_together([lambda i=i, x=x: post(batching_server, "ocr_cls_padded", f"pad-{i}", x, binary=i != 1)
                               for i, x in enumerate(inputs)])
    for i, (x, response) in enumerate(zip(inputs, responses)):
        request_id, got = output(response)
        assert request_id == f"pad-{i}" and got.shape == (x.shape[0], 2)
        np.testing.assert_allclose(got, reference("ocr_cls", x), rtol=1e-4, atol=1e-5)
    after = counters("ocr_cls_padded")
    # every call ran 1, 4 or 8 rows (1: a one-row request alone), however the three arrived
    assert after["requests"] - before["requests"] == 3 and after["retried_alone"] == 0
    calls = {rows: n - before["calls_by_rows"].get(rows, 0) for rows, n in after["calls_by_rows"].items()}
    padding = sum(n * (next(size for size in (1, 4, 8) if size >= rows) - rows) for rows, n in calls.items())
    assert sum(rows * n for rows, n in calls.items()) == 4
    assert after["padded_rows"] - before["padded_rows"] == padding
    (x,) = inputs[:1]
    # A lone request right after a joined batch is padded (the replica counts as loaded: a context
    # keeps its padded shape); the next lone one, the replica idle, runs at batch 1 (issue 30).
    padded = []
    for alone in ("pad-alone-1", "pad-alone-2"):
        start = counters("ocr_cls_padded")["padded_rows"]
        request_id, got = output(post(batching_server, "ocr_cls_padded", alone, x, binary=True))
        assert request_id == alone
        np.testing.assert_allclose(got, reference("ocr_cls", x), rtol=1e-4, atol=1e-5)
        padded.append(counters("ocr_cls_padded")["padded_rows"] - start)
    assert padded[0] in (0, 3) and padded[1] == 0, padded


def test_encoder_requests_of_different_lengths_get_their_own_answers_cut_to_their_length(batching_server, counters):
    """Lengths 5 to 40 in buckets 16, 32 and 64: whatever batches they meet, each answer has the
    request's own length and equals ONNX Runtime's for that request alone; the padding is counted."""
    rng = np.random.default_rng(14)
    lengths = [5, 9, 16, 20, 31, 40]
    feeds = []
    for n in lengths:
        ids = rng.integers(1000, 30000, (1, n), dtype=np.int64)
        feeds.append({"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)})
    before = counters("encoder")

    def send(i: int, feed: dict) -> requests.Response:
        body = {"id": f"enc-{i}", "outputs": [{"name": "last_hidden_state"}],
                "inputs": [{"name": k, "shape": list(v.shape), "datatype": "INT64", "data": v.ravel().tolist()}
                           for k, v in feed.items()]}
        return requests.post(f"{batching_server}/v2/models/encoder/infer", json=body, timeout=120)

    responses = send_together([lambda i=i, f=f: send(i, f) for i, f in enumerate(feeds)])
    session = ort.InferenceSession(f"{REPOSITORY}/{ENCODER}/1/model.onnx", providers=["CPUExecutionProvider"])
    for n, feed, response in zip(lengths, feeds, responses):
        assert response.status_code == 200, response.text
        (tensor,) = response.json()["outputs"]
        assert tensor["shape"] == [1, n, 384]
        (expected,) = session.run(["last_hidden_state"], feed)
        np.testing.assert_allclose(np.array(tensor["data"], np.float32).reshape(1, n, 384), expected, atol=1e-5)
    after = counters("encoder")
    assert after["requests"] - before["requests"] == len(lengths) and after["retried_alone"] == before["retried_alone"]
    assert after["positions"] - before["positions"] == sum(lengths)
    # buckets 16, 16, 16, 32, 32, 64: each request runs at its bucket, alone or joined
    assert after["padded_positions"] - before["padded_positions"] == 16 * 3 + 32 * 2 + 64 - sum(lengths)
