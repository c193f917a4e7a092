"""``make plan``: per model, parameters, predicted and measured footprints, fit on a GPU.

Predictions come from ``residency.predict`` (ONNX graph), measurements from
``residency.footprints`` (ONNX Runtime, one subprocess per model so readings are clean): GPU
bytes on the CUDA provider where it can run here (``GPU``: this process's NVML reading across
loading and warming the contexts at the max profile), else RSS on CPU (``ORT``).
Figures are printed in MiB (2^20 bytes; ``contract.units``).

Command line::

    python -m deployments.runtime.tools.plan plan [--root engines] [--gpu-memory-gib 80] [--headroom 0.15]
        [--precision fp16] [--instances N] [--baseline-mib 0] [--measure] [--json]
    python -m deployments.runtime.tools.plan measure MODEL [--root engines] [--write] [--json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..backends.base import Footprint
from ..backends.cuda import mem_get_info
from ..backends.select import cuda_provider_unavailable
from ..contract.repository import ModelEntry, ModelRepository
from ..contract.shapes import shrunk_shapes
from ..contract.units import MIB, format_mib, mib_to_bytes
from ..residency.footprints import (MEASURE_INPUT_ELEMENTS, RECORD_FILENAME, load_and_measure,
                                    measure_batch_of, measurement_failure, read_record, write_record)
from ..residency.host import ModelHost
from ..residency.predict import CONTEXT_FACTOR, analyze_graph, predict



@dataclass
class ModelPlan:
    """One row of the plan; bytes are totals for ``instances`` contexts where named ``total``."""

    model: str
    parameters: int
    engine_bytes: int
    max_profile: str
    peak_activation_bytes: float
    predicted_context_bytes: int
    measured_engine_bytes: int | None
    measured_context_bytes: int | None
    measured_source: str
    instances: int
    total_bytes: int
    shrink: str
    shrink_saves_bytes: int
    unknown_tensors: int = 0
    notes: list[str] = field(default_factory=list)


def _profile_text(shapes: Mapping[str, Sequence[int]]) -> str:
    return "; ".join("x".join(str(d) for d in s) for s in shapes.values())


def _measure_in_subprocess(root: Path, name: str, measure_elements: int | None,
                           backend: str = "onnxruntime") -> Footprint:
    cmd = [sys.executable, "-m", "deployments.runtime.tools.plan", "measure", name, "--root", str(root), "--json",
           "--measure-elements", str(measure_elements or 0), "--backend", backend]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"measuring {name} failed: {' '.join(done.stderr.strip().splitlines()[-1:])}")
    record = json.loads(done.stdout)
    return Footprint(engine_bytes=record["engine_bytes"], context_bytes=record["context_bytes"], measured=True)


def plan_model(entry: ModelEntry, precision: str | None = None, instances: int | None = None,
               measured: Footprint | None = None, measured_source: str = "") -> ModelPlan:
    """The plan row of one model: prediction, optional measurement, and the shrink saving.

    The total uses the measured figures where given, else the predicted ones. The saving of the
    shrunk profile is the predicted context difference (scaled by measured / predicted when a
    measurement exists) times the instances.
    """
    prediction = predict(entry, precision)
    config = entry.config
    n = instances or config.instances
    engine_bytes = measured.engine_bytes if measured else prediction.engine_bytes
    context_bytes = measured.context_bytes if measured else prediction.context_bytes
    shrink_text, saves = "-", 0
    shrunk = shrunk_shapes(config)
    if shrunk is not None:
        small_shapes, shrink_text = shrunk
        small_batch = next(iter(small_shapes.values()))[0] if config.max_batch_size else 1
        small = analyze_graph(entry.onnx_path(), small_shapes, small_batch, precision).context_bytes()
        scale = context_bytes / prediction.context_bytes if prediction.context_bytes else 1.0
        saves = int(n * (prediction.context_bytes - small) * scale)
    return ModelPlan(
        model=entry.name, parameters=prediction.graph.parameters, engine_bytes=prediction.engine_bytes,
        max_profile=_profile_text(prediction.graph.input_shapes),
        peak_activation_bytes=prediction.graph.peak_activation_bytes,
        predicted_context_bytes=prediction.context_bytes,
        measured_engine_bytes=measured.engine_bytes if measured else None,
        measured_context_bytes=measured.context_bytes if measured else None,
        measured_source=measured_source, instances=n, total_bytes=engine_bytes + n * context_bytes,
        shrink=shrink_text, shrink_saves_bytes=saves, unknown_tensors=prediction.graph.unknown_tensors)


def _mib(n: float | None) -> str:
    """A table cell: the number of MiB, the unit being in the column header."""
    return format_mib(n).removesuffix(" MiB")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool]) -> str:
    """A plain aligned text table."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def render_plan(plans: Sequence[ModelPlan], gpu_memory_bytes: int, headroom: float, baseline_bytes: int,
                precision: str | None) -> str:
    """The plan as text: one row per model, then whether the set fits."""
    headers = ["model", "params", "max profile", "peak act/sample MiB", "engine pred MiB", "ctx pred MiB",
               "engine meas MiB", "ctx meas MiB", "inst", "total MiB", "shrink max profile", "saves MiB"]
    right = [False, True, False, True, True, True, True, True, True, True, False, True]
    rows = [[p.model, f"{p.parameters:,}", p.max_profile, f"{p.peak_activation_bytes / MIB:,.2f}",
             _mib(p.engine_bytes), _mib(p.predicted_context_bytes), _mib(p.measured_engine_bytes),
             _mib(p.measured_context_bytes) + (f" ({p.measured_source})" if p.measured_source else ""),
             str(p.instances), _mib(p.total_bytes), p.shrink, _mib(p.shrink_saves_bytes)] for p in plans]
    total = baseline_bytes + sum(p.total_bytes for p in plans)
    usable = int(gpu_memory_bytes * (1.0 - headroom))
    saves = sum(p.shrink_saves_bytes for p in plans)
    verdict = (f"fits ({format_mib(usable - total)} to spare)" if total <= usable
               else f"does NOT fit (short by {format_mib(total - usable)})")
    shrunk_verdict = "fits" if total - saves <= usable else "does not fit"
    lines = [
        format_table(headers, rows, right),
        "",
        f"context: predicted = {CONTEXT_FACTOR:g} x max batch x peak activation per sample "
        f"(activations sized {'as in the graph' if precision is None else precision}); "
        "measured where a measurement exists. total = engine + instances x context (measured if any).",
        f"set: {format_mib(total)} (baseline {format_mib(baseline_bytes)} + models "
        f"{format_mib(total - baseline_bytes)}); GPU {format_mib(gpu_memory_bytes)} with {headroom:.0%} headroom "
        f"leaves {format_mib(usable)}: {verdict}.",
        f"shrinking every max profile as shown saves {format_mib(saves)} -> {format_mib(total - saves)} "
        f"({shrunk_verdict}).",
    ]
    unknown = [p for p in plans if p.unknown_tensors]
    if unknown:
        lines.append("shape inference left some tensors unsized (not in the peak): "
                     + ", ".join(f"{p.model} {p.unknown_tensors}" for p in unknown))
    return "\n".join(lines)


def _cmd_plan(args: argparse.Namespace) -> int:
    repo = ModelRepository(args.root)
    entries = [e for e in repo.entries() if not e.config.pipeline]
    if args.models:
        entries = [repo.get(n) for n in args.models]
    # Where ONNX Runtime's CUDA provider runs, measurements are GPU bytes on it; else host bytes on CPU.
    backend = "onnxruntime" if cuda_provider_unavailable() else "onnxruntime_cuda"
    label = "GPU" if backend == "onnxruntime_cuda" else "ORT"
    if backend == "onnxruntime_cuda" and args.gpu_memory_gib is None:
        args.gpu_memory_gib = mem_get_info()[1] / 2**30
    args.gpu_memory_gib = args.gpu_memory_gib or 80.0
    plans = []
    for entry in entries:
        measured, source = read_record(entry, backend), "recorded"
        if measured is None and args.measure:
            measured, source = _measure_in_subprocess(Path(args.root), entry.name, args.measure_elements, backend), label
        plans.append(plan_model(entry, args.precision, args.instances, measured, source if measured else ""))
    gpu_bytes = mib_to_bytes(args.gpu_memory_gib * 1024)
    baseline = mib_to_bytes(args.baseline_mib)
    if args.json:
        total = baseline + sum(p.total_bytes for p in plans)
        usable = int(gpu_bytes * (1 - args.headroom))
        print(json.dumps({"models": [asdict(p) for p in plans], "total_bytes": total, "usable_bytes": usable,
                          "fits": total <= usable, "gpu_memory_bytes": gpu_bytes, "headroom": args.headroom,
                          "baseline_bytes": baseline, "precision": args.precision}, indent=2))
    else:
        print(render_plan(plans, gpu_bytes, args.headroom, baseline, args.precision))
    return 0


def _cmd_measure(args: argparse.Namespace) -> int:
    entry = ModelRepository(args.root).get(args.model)
    host = ModelHost(entry, args.backend)
    start = time.perf_counter()
    footprint = load_and_measure(host, args.measure_elements)
    seconds = time.perf_counter() - start
    backend = host.engine.backend if host.engine is not None else args.backend
    host.unload()
    if not footprint.measured:  # the model refused the measuring runs' zeros: nothing measured
        print(f"{entry.name} ({backend}): not measured: {measurement_failure(entry, backend)}", file=sys.stderr)
        return 1
    record: dict[str, Any] = {"model": entry.name, "backend": backend, "engine_bytes": footprint.engine_bytes,
              "context_bytes": footprint.context_bytes, "instances": entry.config.instances,
              "total_bytes": footprint.total(entry.config.instances),
              "measure_batch": measure_batch_of(entry.config, args.measure_elements),
              "seconds": round(seconds, 3)}
    if args.write:
        record["written"] = str(write_record(entry, backend, footprint, args.measure_elements))
    if args.json:
        print(json.dumps(record))
    else:
        print(f"{entry.name} ({backend}): engine {format_mib(footprint.engine_bytes)}, context "
              f"{format_mib(footprint.context_bytes)}, total for {entry.config.instances} instances "
              f"{format_mib(record['total_bytes'])} (measured in {seconds:.1f} s)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m deployments.runtime.tools.plan``."""
    parser = argparse.ArgumentParser(prog="python -m deployments.runtime.tools.plan", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="predict (and optionally measure) each model's memory; check a GPU fits")
    plan.add_argument("--root", default="engines", help="model repository (default: engines)")
    plan.add_argument("--models", nargs="*", help="only these models (default: every non-pipeline model)")
    plan.add_argument("--gpu-memory-gib", type=float, default=None,
                      help="GPU memory in GiB (2^30 bytes; default: this machine's GPU, else 80)")
    plan.add_argument("--headroom", type=float, default=0.15, help="fraction kept free (0.15-0.20)")
    plan.add_argument("--baseline-mib", type=float, default=0.0,
                      help="MiB the process holds before any model (CUDA context, libraries)")
    plan.add_argument("--instances", type=int, default=None, help="contexts per model (default: config)")
    plan.add_argument("--precision", choices=["fp16", "fp32"], default=None,
                      help="size floating-point weights and activations at this precision "
                           "(default: as in the ONNX graph)")
    plan.add_argument("--measure", action="store_true",
                      help="measure each model with ONNX Runtime (one subprocess each)")
    plan.add_argument("--measure-elements", type=int, default=MEASURE_INPUT_ELEMENTS,
                      help="input elements of a measuring run (sets its batch; 0 = the full max batch)")
    plan.add_argument("--json", action="store_true", help="print JSON instead of a table")
    measure = sub.add_parser("measure", help="load one model with ONNX Runtime and measure its footprint")
    measure.add_argument("model")
    measure.add_argument("--root", default="engines")
    measure.add_argument("--backend", default="onnxruntime")
    measure.add_argument("--measure-elements", type=int, default=MEASURE_INPUT_ELEMENTS,
                         help="input elements of a measuring run (sets its batch; 0 = the full max batch)")
    measure.add_argument("--write", action="store_true", help=f"record it in <model>/<version>/{RECORD_FILENAME}")
    measure.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.measure_elements == 0:
        args.measure_elements = None
    return _cmd_plan(args) if args.command == "plan" else _cmd_measure(args)


if __name__ == "__main__":
    sys.exit(main())
