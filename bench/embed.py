"""Sentence embeddings under load: the ``embed`` pipeline served with sequence bucketing and
dynamic batching on and off, beside the encoder called in-process, on one text mix.

The texts: a realistic mix for a RAG stack, half short queries (4-12 words) and half passages
of 100-200 tokens, words drawn (seeded) from the encoder's own WordPiece vocabulary. Every
request carries one text, as a query path does; each client cycles through the mix
(``loadgen.Workload.alternatives``). Every answer is checked: an FP32 [1, 384] embedding, and
one in 16 per client equal to the in-process reference (``reference``: ``tokenizers`` + ONNX
Runtime on the CPU + mean pooling + L2, apart from the server's code) within ``--atol``.

Variants (``VARIANTS``: the encoder's config, and ``PIPELINE_VARIANTS``: the pipeline's
parameters), each a fresh cluster serving ``embed`` and its encoder:
  unbatched           no batching anywhere: the pipeline sends each text in its own encoder call
                      (``batch_size`` 1, no bound on calls in flight but the replica's), the
                      encoder without dynamic batching: each text at its own sequence length (on
                      a GPU, one new shape per length)
  joined              the encoder without dynamic batching, the pipeline as shipped: its replica
                      joins the texts that wait while ``replica_calls_in_flight`` calls run into
                      one call padded to its longest (``pipelines.JoinedCalls``)
  bucketed            as shipped: dynamic batching with sequence buckets [16, 32, 64, 128, 256]
                      (``dynamic_batching.sequence_buckets``): calls padded to a bucket, joined
                      while the execution contexts are busy
  bucketed_padded     bucketed, and rows padded to 8 or 32 where the backend pads
                      (``pad_to_preferred: auto``: ONNX Runtime CUDA)
  batched_unbucketed  dynamic batching without buckets: only calls of one length join
In-process rows: the same texts through ``reference`` in this process, one text a call
(``inprocess_b1``) and 32 a call padded to the longest (``inprocess_b32``): what the engine
does with no server around it.

Reported per variant and client count: texts/s, p50, p99, errors, and from the encoder
replica's batch counters the padding waste (padded sequence positions over all positions the
encoder ran), from the encoder's statistics (rows over executions) the texts per encoder call,
and from ``/proc`` the CPU milliseconds per text of
the pipeline's replicas and of the encoder's (``bench.replicas.CpuSampler``, over the measured
window: every thread of those processes).

    python -m bench.embed [--clients 1,16,64,256] [--duration-s 10] [--gpu-fraction 0.25]
        [--variants unbatched,joined,bucketed] [--out bench/results/embed.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import yaml

from bench.loadgen import Expected, Workload, run
from bench.replicas import CpuSampler, replica_pids
from bench.throughput import ROOT, Server, _write_model
from deployments.client import deployment_name

ENCODER = "all-MiniLM-L6-v2"
PIPELINE = "embed"
MAX_SEQ_LENGTH = 256
BUCKETS = [16, 32, 64, 128, 256]
STATS_LAG_S = 2.0  # the statistics lag the requests by the metrics' report interval
MAX_ONGOING = 512  # each replica's max_ongoing_requests here
VARIANTS: dict[str, dict[str, Any]] = {
    "unbatched": {"dynamic_batching": {"enabled": False}},
    "joined": {"dynamic_batching": {"enabled": False}},
    "bucketed": {"dynamic_batching": {"max_queue_delay_ms": 2, "sequence_buckets": BUCKETS}},
    "bucketed_padded": {"dynamic_batching": {"max_queue_delay_ms": 2, "sequence_buckets": BUCKETS,
                                             "preferred_batch_size": [8, 32]}},
    "batched_unbucketed": {"dynamic_batching": {"max_queue_delay_ms": 2, "sequence_buckets": []}},
}
PIPELINE_VARIANTS: dict[str, dict[str, Any]] = {
    "unbatched": {"batch_size": 1, "replica_calls_in_flight": MAX_ONGOING},
}


def make_texts(count: int, seed: int = 0) -> list[str]:
    """``count`` texts, alternately a query (4-12 words) and a passage (100-200 tokens), of
    whole words from the encoder's vocabulary (seeded)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(ROOT / "engines" / ENCODER / "1" / "tokenizer.json"))
    tokenizer.no_truncation()  # the file truncates at 128
    tokenizer.no_padding()
    words = sorted(w for w in tokenizer.get_vocab() if w.isalpha() and w.isascii() and len(w) > 2)
    rng = np.random.default_rng(seed)
    texts = []
    for i in range(count):
        if i % 2 == 0:
            texts.append(" ".join(rng.choice(words, int(rng.integers(4, 13)))) + "?")
            continue
        target, text = int(rng.integers(100, 201)), []
        while len(tokenizer.encode(" ".join(text)).ids) < target:
            text.extend(rng.choice(words, 8))
        texts.append(" ".join(text))
    return texts


class Reference:
    """The embedding as sentence-transformers computes it, in this process: ``tokenizers``
    (truncation at 256, padding to the longest of a call), ONNX Runtime on the CPU (or CUDA),
    mean pooling over the mask, L2 normalisation."""

    def __init__(self, providers: Sequence[str] = ("CPUExecutionProvider",)) -> None:
        import onnxruntime
        from tokenizers import Tokenizer

        folder = ROOT / "engines" / ENCODER / "1"
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(MAX_SEQ_LENGTH)
        self.session = onnxruntime.InferenceSession(str(folder / "model.onnx"), providers=list(providers))

    def __call__(self, texts: Sequence[str]) -> np.ndarray:
        encodings = self.tokenizer.encode_batch(list(texts))
        length = max(len(e.ids) for e in encodings)
        ids = np.zeros((len(texts), length), np.int64)
        mask = np.zeros_like(ids)
        for row, e in enumerate(encodings):
            ids[row, :len(e.ids)] = e.ids
            mask[row, :len(e.ids)] = 1
        (hidden,) = self.session.run(["last_hidden_state"], {
            "input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)})
        summed = (hidden * mask[..., None]).sum(axis=1) / mask.sum(axis=1, keepdims=True)
        return summed / np.maximum(np.linalg.norm(summed, axis=1, keepdims=True), 1e-12)


def workload(base_url: str, texts: Sequence[str], references: np.ndarray, atol: float) -> Workload:
    """One text per request, the client cycling through ``texts``; each answer must be its
    text's FP32 [1, 384] embedding (values compared for a sample, within ``atol``)."""
    requests = []
    for text, ref in zip(texts, references):
        body = json.dumps({"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": [text]}],
                           "outputs": [{"name": "embedding"}]}).encode()
        requests.append((body, Expected.of({"embedding": ref[None].astype(np.float32)}, {"embedding": "FP32"},
                                           rtol=0.0, atol=atol)))
    (body, expected), *rest = requests
    return Workload("embed", f"{base_url}/v2/models/{PIPELINE}/infer", body,
                    {"Content-Type": "application/json"}, expected, tuple(rest))


def prepare(dest: Path, variant: str, gpu_fraction: float, replicas: int, pipeline_replicas: int = 1,
            calls_in_flight: int | None = None) -> Path:
    """A repository at ``dest``: the embed pipeline and its encoder, configured as ``variant``
    (``calls_in_flight``: the pipeline's ``replica_calls_in_flight`` where the variant joins
    calls; None: as shipped)."""
    encoder = yaml.safe_load((ROOT / "engines" / ENCODER / "config.yaml").read_text())
    encoder.update(VARIANTS[variant])
    encoder["deployment"] = {"mode": "dedicated", "num_replicas": replicas, "num_cpus": 0.1,
                             "max_ongoing_requests": MAX_ONGOING,
                             **({"num_gpus": gpu_fraction} if gpu_fraction else {})}
    pipeline = yaml.safe_load((ROOT / "engines" / PIPELINE / "config.yaml").read_text())
    parameters = pipeline.setdefault("parameters", {})
    if calls_in_flight is not None:
        parameters["replica_calls_in_flight"] = calls_in_flight
    parameters.update(PIPELINE_VARIANTS.get(variant, {}))
    pipeline["deployment"] = {"mode": "dedicated", "num_replicas": pipeline_replicas, "num_cpus": 0.1,
                              "max_ongoing_requests": MAX_ONGOING}
    _write_model(dest, ROOT / "engines", ENCODER, ENCODER, encoder)
    _write_model(dest, ROOT / "engines", PIPELINE, PIPELINE, pipeline)
    return dest


def encoder_counts(base_url: str) -> tuple[int, int]:
    """The encoder's (rows, executions) so far, from the statistics extension: rows over
    executions is the texts per encoder call, whether or not the encoder batches."""
    with urllib.request.urlopen(f"{base_url}/v2/models/{ENCODER}/stats", timeout=30) as r:
        stats = json.load(r)["model_stats"]
    return sum(s["inference_count"] for s in stats), sum(s["execution_count"] for s in stats)


def padding_waste(stats: dict[str, Any]) -> float | None:
    """Padded sequence positions over all the encoder ran, from its batch counters (None when
    the replica does not count them)."""
    padded, real = stats.get("padded_positions"), stats.get("positions")
    if not real or padded is None:
        return None
    return round(padded / (padded + real), 4)


def in_process(reference: Reference, texts: Sequence[str], batch: int, duration_s: float) -> dict[str, Any]:
    """Texts/s and per-call p50 of ``reference`` on ``texts``, ``batch`` texts a call, for
    ``duration_s``."""
    latencies, done, i = [], 0, 0
    stop = time.perf_counter() + duration_s
    while time.perf_counter() < stop:
        chunk = [texts[(i + k) % len(texts)] for k in range(batch)]
        start = time.perf_counter()
        reference(chunk)
        latencies.append(time.perf_counter() - start)
        done, i = done + batch, i + batch
    elapsed = sum(latencies)
    return {"variant": f"inprocess_b{batch}", "clients": 1, "texts_per_s": round(done / elapsed, 1),
            "p50_ms": round(float(np.median(latencies)) * 1e3, 2), "p99_ms": round(float(np.percentile(latencies, 99)) * 1e3, 2),
            "errors": 0}


def main(argv: Sequence[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", default="1,16,64,256")
    p.add_argument("--variants", default="unbatched,joined,bucketed")
    p.add_argument("--duration-s", type=float, default=10.0)
    p.add_argument("--warmup-s", type=float, default=3.0)
    p.add_argument("--in-process", default="1,32", help="texts per in-process call, one row each ('': none)")
    p.add_argument("--texts", type=int, default=64, help="texts in the mix (half queries, half passages)")
    p.add_argument("--gpu-fraction", type=float, default=0.0, help="the encoder's num_gpus (0: CPU)")
    p.add_argument("--replicas", type=int, default=1, help="replicas of the encoder")
    p.add_argument("--pipeline-replicas", type=int, default=1, help="replicas of the embed pipeline")
    p.add_argument("--calls-in-flight", type=int, default=None,
                   help="the pipeline's replica_calls_in_flight where the variant joins calls (default: as shipped)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--processes", type=int, default=1, help="client processes")
    p.add_argument("--atol", type=float, default=None, help="answer tolerance (default 1e-4 CPU, 2e-3 GPU)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "embed.json"))
    a = p.parse_args(argv)
    clients = [int(c) for c in a.clients.split(",")]
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # Ray's workers
    atol = a.atol if a.atol is not None else (2e-3 if a.gpu_fraction else 1e-4)
    texts = make_texts(a.texts)
    reference = Reference()
    references = np.concatenate([reference([t]) for t in texts])
    rows: list[dict[str, Any]] = []
    providers = ["CUDAExecutionProvider"] if a.gpu_fraction else ["CPUExecutionProvider"]
    engine = reference if not a.gpu_fraction else Reference(providers)
    for batch in [int(b) for b in a.in_process.split(",") if b]:
        rows.append(in_process(engine, texts, batch, a.duration_s))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    for variant in a.variants.split(","):
        repo = prepare(Path(tempfile.mkdtemp(prefix=f"embed-{variant}-")), variant, a.gpu_fraction, a.replicas,
                       a.pipeline_replicas, a.calls_in_flight)
        with Server("ray", repo, "fast", replicas=1, backend=a.backend) as server:
            w = workload(server.url, texts, references, atol)
            pids = {role: replica_pids(server.process.pid, "models", deployment_name(model, role == "pipeline"))
                    for role, model in (("pipeline", PIPELINE), ("encoder", ENCODER))}
            for c in clients:
                before, counts_before = server.batch_stats(ENCODER), encoder_counts(server.url)
                samplers = {role: CpuSampler(p) for role, p in pids.items()}
                with samplers["pipeline"], samplers["encoder"]:
                    (r,) = run([(w, c)], a.duration_s, a.warmup_s, a.processes)
                after = server.batch_stats(ENCODER)
                time.sleep(STATS_LAG_S)
                rows_run, calls = (b - a for a, b in zip(counts_before, encoder_counts(server.url)))
                cpu = {f"{role}_cpu_ms_per_text": round(s.window(a.duration_s)[1] * 1e3 / r.qps, 3) if r.qps else None
                       for role, s in samplers.items()}
                delta = {k: after[k] - before.get(k, 0) for k in ("padded_positions", "positions", "rows", "batches")
                         if k in after}
                rows.append({"variant": variant, "clients": c, "texts_per_s": r.qps, "p50_ms": r.p50_ms,
                             "p99_ms": r.p99_ms, "errors": r.errors, "error_statuses": r.error_statuses,
                             "error_examples": r.error_examples,
                             "padding_waste": padding_waste(delta),
                             "rows_per_call": round(rows_run / calls, 2) if calls > 0 else None,
                             **cpu})
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    meta = {"machine": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M"), "args": vars(a)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(markdown(rows))


def markdown(rows: list[dict[str, Any]]) -> str:
    """A table: one line per variant and client count."""
    out = ["| variant | clients | texts/s | p50 ms | p99 ms | errors | padding waste |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        waste = r.get("padding_waste")
        out.append(f"| {r['variant']} | {r['clients']} | {r['texts_per_s']} | {r['p50_ms']} | {r['p99_ms']} | "
                   f"{r['errors']} | {'-' if waste is None else f'{waste:.1%}'} |")
    return "\n".join(out)


if __name__ == "__main__":
    main(sys.argv[1:])
