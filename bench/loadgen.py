"""Closed-loop load generator for any KServe v2 endpoint (JSON or Triton binary tensors).

Each of ``concurrency`` workers sends one request, waits for the answer, and sends the next:
the offered load follows the server's speed (closed loop). Requests are built once and
replayed, so the client spends its time on HTTP, not on encoding. A run warms up for
``warmup_s``, then counts the requests that complete within the next ``duration_s``, whenever
they were sent (with a queue of seconds, requests sent in the warm-up complete in the window;
counting only those sent and completed inside it would under-count by latency / window):
QPS = completed / duration_s; latency percentiles are over those requests (successes only;
errors are counted apart by status: ``503`` is a request shed as it should be, with
``Retry-After`` and a ``{"error": ...}`` body, after which the worker waits ``Retry-After``
seconds as a polite client does; a bare 503 is counted apart).

A workload that carries an ``Expected`` has its answers checked, not only their status: every
200 is parsed (``tritonclient.http.InferResult``, JSON or binary) and each expected output's
datatype, shape and byte count checked; every ``sample_every``-th answer of a worker also has
its values compared with a reference computed apart (``expected_from_onnx``: the model file
run in-process by ONNX Runtime). A 200 that fails a check counts as an error
(``wrong answer: ...``), never as a success: a server answering 200 with empty outputs
scores zero.

Several workloads can run at once (``run``), e.g. two models together; ``processes > 1``
splits every workload's workers across that many client processes (one event loop each) so
the client is not the bottleneck on a many-core machine.

    python -m bench.loadgen --url http://127.0.0.1:8000 --model tiny_cnn --shape 1,3,224,224 \\
        --concurrency 1,2,4,8,16,32,64 --duration-s 10 [--binary] [--out result.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import sys
import time
from pathlib import Path
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import numpy as np

HEADER_LENGTH = "Inference-Header-Content-Length"
SWEEP = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class Expected:
    """What every answer to a workload must hold.

    ``outputs``: name -> (KServe v2 datatype, shape) of each output the answer must carry;
    ``values``: name -> the reference array a sampled answer's output must equal (within
    ``rtol`` / ``atol``; BYTES exactly); ``sample_every``: one answer in this many per worker
    has its values compared (the first one included).
    """

    outputs: dict[str, tuple[str, tuple[int, ...]]]
    values: dict[str, np.ndarray] = field(default_factory=dict)
    rtol: float = 1e-4
    atol: float = 1e-4
    sample_every: int = 16

    @classmethod
    def of(cls, values: dict[str, np.ndarray], datatypes: dict[str, str], **kwargs) -> "Expected":
        """Every output of ``values`` expected with its shape, and compared when sampled."""
        return cls({n: (datatypes[n], tuple(v.shape)) for n, v in values.items()}, values, **kwargs)

    def problem(self, body: bytes, headers, compare: bool) -> str | None:
        """What is wrong with a 200 answer's ``body`` (None: nothing); ``compare``: check the
        values too."""
        from tritonclient.http import InferResult

        length = headers.get(HEADER_LENGTH)
        try:
            result = InferResult.from_response_body(body, header_length=int(length) if length else None)
            described = {o["name"]: o for o in result.get_response().get("outputs", [])}
            for name in self.outputs:
                out = described.get(name)
                if out is None:
                    return f"no output {name!r} (answered: {sorted(described)})"
                problem = self.output_problem(name, out.get("datatype"), out.get("shape", ()),
                                              (out.get("parameters") or {}).get("binary_data_size"),
                                              lambda: result.as_numpy(name), compare)
                if problem is not None:
                    return problem
        except Exception as e:  # an answer the client cannot parse is a wrong answer
            return f"unparseable answer ({type(e).__name__}: {e})"
        return None

    def output_problem(self, name: str, datatype: str | None, shape: Sequence[int], size: int | None,
                       array_of: Callable[[], np.ndarray | None], compare: bool) -> str | None:
        """What is wrong with output ``name`` as an answer describes it (``datatype``, ``shape``,
        ``size``: the bytes it says it carries, None: unsaid) and carries it (``array_of()``:
        its data, read only once the description is right); None: nothing. ``compare``: check
        the values too. Any protocol's answer (HTTP, gRPC raw contents, shared memory) is
        checked here."""
        from tritonclient.utils import triton_to_np_dtype

        want_datatype, want_shape = self.outputs[name]
        if datatype != want_datatype or tuple(shape) != want_shape:
            return f"output {name!r} is {datatype} {list(shape)}, expected {want_datatype} {list(want_shape)}"
        if datatype != "BYTES" and size is not None:
            want = int(np.prod(want_shape)) * np.dtype(triton_to_np_dtype(datatype)).itemsize
            if size != want:
                return f"output {name!r} carries {size} bytes, expected {want}"
        array = array_of()
        if array is None or array.shape != want_shape:
            got = None if array is None else list(array.shape)
            return f"output {name!r} carries data of shape {got}, expected {list(want_shape)}"
        reference = self.values.get(name)
        if compare and reference is not None:
            if datatype == "BYTES":
                same = [bytes(a) for a in array.ravel()] == [bytes(b) for b in reference.ravel()]
            else:
                same = np.allclose(array, reference, rtol=self.rtol, atol=self.atol)
            if not same:
                return f"output {name!r} differs from the reference"
        return None


def expected_from_onnx(model_file: str, inputs: dict[str, np.ndarray] | np.ndarray, **kwargs) -> Expected:
    """The reference answer for ``inputs`` (one array: the model's first input):
    ``model_file`` run in-process by ONNX Runtime on the CPU, every output expected (its
    datatype from the array)."""
    import onnxruntime
    from tritonclient.utils import np_to_triton_dtype

    session = onnxruntime.InferenceSession(model_file, providers=["CPUExecutionProvider"])
    if isinstance(inputs, np.ndarray):
        inputs = {session.get_inputs()[0].name: inputs}
    names = [o.name for o in session.get_outputs()]
    values = dict(zip(names, session.run(names, inputs)))
    return Expected.of(values, {n: np_to_triton_dtype(v.dtype) for n, v in values.items()}, **kwargs)


@dataclass(frozen=True)
class Workload:
    """One endpoint and the request replayed against it (body built once); ``expected``: what
    its answers must hold (None: only the status is checked). ``alternatives``: more
    ``(body, expected)`` requests to the same URL; each worker then cycles through all of them,
    from its own starting point (a mix of requests, e.g. short and long texts)."""

    label: str
    url: str
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)
    expected: Expected | None = None
    alternatives: tuple[tuple[bytes, Expected | None], ...] = ()

    def requests(self) -> list[tuple[bytes, Expected | None]]:
        """Every ``(body, expected)`` this workload sends."""
        return [(self.body, self.expected), *self.alternatives]


def make_workload(label: str, base_url: str, model: str, input_name: str, x: np.ndarray,
                  binary: bool = False, datatype: str = "FP32", expected: Expected | None = None) -> Workload:
    """A KServe v2 infer request for one input tensor ``x``.

    ``binary``: input and outputs as Triton binary tensor data (``Inference-Header-Content-Length``);
    else JSON ``data`` in and out. ``expected``: what its answers must hold.
    """
    url = f"{base_url.rstrip('/')}/v2/models/{model}/infer"
    tensor = {"name": input_name, "shape": list(x.shape), "datatype": datatype}
    if not binary:
        body = json.dumps({"inputs": [{**tensor, "data": x.ravel().tolist()}]}).encode()
        return Workload(label, url, body, {"Content-Type": "application/json"}, expected)
    raw = np.ascontiguousarray(x).tobytes()
    head = json.dumps({"inputs": [{**tensor, "parameters": {"binary_data_size": len(raw)}}],
                       "parameters": {"binary_data_output": True}}).encode()
    return Workload(label, url, head + raw,
                    {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(len(head))}, expected)


@dataclass
class Result:
    """One workload at one concurrency: throughput and latency of the measured window."""

    label: str
    concurrency: int
    duration_s: float
    requests: int
    errors: int
    qps: float
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    error_statuses: dict[str, int] = field(default_factory=dict)
    error_examples: dict[str, str] = field(default_factory=dict)  # status -> the first such answer's body (500 chars)


def is_shed(headers, body: bytes) -> bool:
    """A 503 as the server sheds load: a ``Retry-After`` header and a ``{"error": ...}`` body."""
    try:
        return "Retry-After" in headers and "error" in json.loads(body)
    except ValueError:
        return False


@dataclass
class _Samples:
    latencies_s: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    examples: dict[str, str] = field(default_factory=dict)

    def add(self, sent: float, done: float, status: str, answer: bytes, start: float, stop: float) -> None:
        """One answer (``status`` "200": a good one) sent at ``sent``, completed at ``done``
        (``time.perf_counter``), counted if it completed in the window ``[start, stop]``."""
        if start <= done <= stop:  # completed in the window (sent before it, too, under a long queue)
            if status == "200":
                self.latencies_s.append(done - sent)
            else:
                self.errors[status] = self.errors.get(status, 0) + 1
                if status not in self.examples and status.isdigit():
                    self.examples[status] = answer[:500].decode(errors="replace")


async def _worker(session, workload: Workload, start: float, stop: float, samples: _Samples,
                  first: int = 0) -> None:
    import aiohttp

    requests = workload.requests()
    answers = 0
    while True:
        retry_after_s = None
        body, expected = requests[(first + answers) % len(requests)]
        answer = b""
        sent = time.perf_counter()
        if sent >= stop:
            return
        try:
            async with session.post(workload.url, data=body, headers=workload.headers) as response:
                answer = await response.read()
                status = str(response.status)
                if status == "503" and is_shed(response.headers, answer):
                    retry_after_s = float(response.headers["Retry-After"])
                elif status == "503":
                    status = "503 without Retry-After or error body"
                elif status == "200" and expected is not None:
                    sampled = answers // len(requests) % expected.sample_every == 0
                    problem = expected.problem(answer, response.headers, sampled)
                    if problem is not None:
                        status = f"wrong answer: {problem}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            status = type(e).__name__
        answers += 1
        done = time.perf_counter()
        samples.add(sent, done, status, answer, start, stop)
        if retry_after_s is not None:  # a polite client waits as told (never past the window)
            await asyncio.sleep(max(0.0, min(retry_after_s, stop - done)))


async def _closed_loop(plan: Sequence[tuple[Workload, int]], warmup_s: float,
                       duration_s: float) -> list[_Samples]:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=max(60.0, 3 * duration_s))
    # Accept-Encoding: identity, as tritonclient and perf_analyzer send by default: aiohttp would
    # ask for gzip, which the product grants (8% of a GPU replica's CPU went to zlib on H200,
    # py-spy, docs/lab-notes.md, "One hop to hot models") and the single-process baseline does not.
    sessions = [aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=max(1, c), force_close=False),
                                      timeout=timeout, headers={"Accept-Encoding": "identity"}) for _, c in plan]
    start = time.perf_counter() + warmup_s
    stop = start + duration_s
    samples = [_Samples() for _ in plan]
    try:
        await asyncio.gather(*(
            _worker(session, workload, start, stop, s, first)
            for (workload, concurrency), session, s in zip(plan, sessions, samples)
            for first in range(concurrency)))
    finally:
        for session in sessions:
            await session.close()
    return samples


def _run_in_process(args: tuple[list[tuple[Workload, int]], float, float]) -> list[_Samples]:
    plan, warmup_s, duration_s = args
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    return asyncio.run(_closed_loop(plan, warmup_s, duration_s))


def _percentile_ms(latencies: np.ndarray, q: float) -> float | None:
    return round(float(np.percentile(latencies, q)) * 1e3, 3) if latencies.size else None


def split_clients(concurrency: int, parts: int) -> list[int]:
    """``concurrency`` clients split over ``parts`` (workloads, or client processes) as evenly
    as can be (the first ones get one more)."""
    return [concurrency // parts + (1 if i < concurrency % parts else 0) for i in range(parts)]


def run(plan: Sequence[tuple[Workload, int]], duration_s: float = 10.0, warmup_s: float = 2.0,
        processes: int = 1, runner: Callable[[tuple], list[_Samples]] = _run_in_process) -> list[Result]:
    """Run every ``(workload, concurrency)`` at once; one ``Result`` per workload.

    ``processes > 1``: each workload's workers are split across that many client processes
    (a workload with fewer workers than processes uses fewer). ``runner``: what each client
    process runs, ``runner((share, warmup_s, duration_s))`` -> one ``_Samples`` per workload of
    ``share`` (its ``(workload, clients)``); the default sends ``Workload``s over HTTP, another
    protocol brings its own (a module-level function: it crosses to spawned processes) with
    workloads of its own kind (anything with a ``label``).
    """
    processes = max(1, processes)
    splits = [split_clients(c, processes) for _, c in plan]
    shares = []
    for p in range(processes):
        share = [(w, split[p]) for (w, _), split in zip(plan, splits)]
        if any(c for _, c in share):
            shares.append(share)
    if len(shares) == 1:
        parts = [runner((shares[0], warmup_s, duration_s))]
    else:
        with multiprocessing.get_context("spawn").Pool(len(shares)) as pool:
            parts = pool.map(runner, [(s, warmup_s, duration_s) for s in shares])
    return [merge(workload.label, concurrency, duration_s, [part[i] for part in parts])
            for i, (workload, concurrency) in enumerate(plan)]


def merge(label: str, concurrency: int, duration_s: float, parts: Sequence[_Samples]) -> Result:
    """One ``Result`` of the samples of one workload's client processes."""
    latencies = np.array([x for part in parts for x in part.latencies_s])
    errors: dict[str, int] = {}
    examples: dict[str, str] = {}
    for part in parts:
        for status, n in part.errors.items():
            errors[status] = errors.get(status, 0) + n
        examples = {**part.examples, **examples}
    return Result(
        label=label, concurrency=concurrency, duration_s=duration_s,
        requests=int(latencies.size), errors=sum(errors.values()),
        qps=round(latencies.size / duration_s, 2), p50_ms=_percentile_ms(latencies, 50),
        p90_ms=_percentile_ms(latencies, 90), p99_ms=_percentile_ms(latencies, 99),
        error_statuses=errors, error_examples=examples)


def sweep(workload: Workload, levels: Sequence[int] = SWEEP, duration_s: float = 10.0,
          warmup_s: float = 2.0, processes: int = 1) -> list[Result]:
    """One workload at each concurrency in ``levels``, one after another."""
    return [run([(workload, c)], duration_s, warmup_s, processes)[0] for c in levels]


def _input_name(base_url: str, model: str) -> str:
    import urllib.request

    with urllib.request.urlopen(f"{base_url.rstrip('/')}/v2/models/{model}", timeout=30) as r:
        return json.load(r)["inputs"][0]["name"]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", required=True)
    parser.add_argument("--shape", required=True, help="input shape, e.g. 1,3,224,224 (random FP32 data)")
    parser.add_argument("--input-name", help="default: the first input of GET /v2/models/{model}")
    parser.add_argument("--binary", action="store_true", help="Triton binary tensors in and out")
    parser.add_argument("--concurrency", default=",".join(map(str, SWEEP)))
    parser.add_argument("--duration-s", type=float, default=10.0)
    parser.add_argument("--warmup-s", type=float, default=2.0)
    parser.add_argument("--processes", type=int, default=1, help="client processes")
    parser.add_argument("--reference", default="auto",
                        help="ONNX file whose in-process output every answer is checked against (shape and size "
                             "of each, values of a sample); auto: engines/<model>/1/model.onnx if there; none: "
                             "status only")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)

    shape = tuple(int(d) for d in args.shape.split(","))
    x = np.random.default_rng(0).random(shape, dtype=np.float32)
    name = args.input_name or _input_name(args.url, args.model)
    reference = args.reference
    if reference == "auto":
        candidate = Path(__file__).resolve().parents[1] / "engines" / args.model / "1" / "model.onnx"
        reference = str(candidate) if candidate.exists() else "none"
    expected = None if reference == "none" else expected_from_onnx(reference, {name: x})
    workload = make_workload(args.model, args.url, args.model, name, x, args.binary, expected=expected)
    levels = [int(c) for c in args.concurrency.split(",")]
    results = sweep(workload, levels, args.duration_s, args.warmup_s, args.processes)
    print(f"{'concurrency':>11} {'QPS':>9} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'errors':>6}")
    for r in results:
        print(f"{r.concurrency:>11} {r.qps:>9.1f} {r.p50_ms or 0:>8.2f} {r.p90_ms or 0:>8.2f} "
              f"{r.p99_ms or 0:>8.2f} {r.errors:>6}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=2)


if __name__ == "__main__":
    main(sys.argv[1:])
