"""What CUDA graphs captured at load add to a context's measured footprint (ONNX Runtime CUDA).

For each model and each set of batch sizes, loads one context with graphs captured at those
sizes (none: without graphs) and prints its measured context bytes and the process's GPU bytes
after requests at every captured size.

    python -m bench.graph_memory [--models resnet18,tiny_cnn] [--sets none,1,1-8,1-2-4-8-16-32]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np

from deployments.runtime.backends import onnxruntime_cuda
from deployments.runtime.backends.gpu_memory import process_gpu_bytes
from deployments.runtime.contract.repository import ModelRepository
from deployments.runtime.residency.host import ModelHost

MB = 1 << 20


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="engines")
    p.add_argument("--models", default="resnet18,tiny_cnn")
    p.add_argument("--sets", default="none,1,1-8,1-2-4-8-16-32")
    p.add_argument("--workspace", default="1", help="cudnn_conv_use_max_workspace: 1, 0 or 1,0")
    args = p.parse_args()
    onnxruntime_cuda.prime()
    for model in args.models.split(","):
        repo = ModelRepository(args.root, [model])
        for ws in args.workspace.split(","):
            for spec in args.sets.split(","):
                batches = None if spec == "none" else tuple(int(b) for b in spec.split("-"))
                entry = repo.get(model)
                opts = entry.config.onnxruntime_cuda.model_copy(update={"cuda_graphs": batches is not None,
                                                                         "cudnn_conv_use_max_workspace": ws == "1"})
                entry = dataclasses.replace(entry, config=entry.config.model_copy(
                    update={"instances": 1, "onnxruntime_cuda": opts}))
                real = onnxruntime_cuda.graph_batches
                onnxruntime_cuda.graph_batches = lambda config, b=batches: b or real(config)
                before = process_gpu_bytes().bytes
                try:
                    host = ModelHost(entry, "onnxruntime_cuda").load()
                finally:
                    onnxruntime_cuda.graph_batches = real
                loaded = process_gpu_bytes().bytes
                for b in batches or (1, 8):
                    host.infer({"input": np.zeros((b, *entry.config.inputs[0].dims[1:]), np.float32)})
                served = process_gpu_bytes().bytes
                print(json.dumps({"model": model, "graphs": spec, "max_workspace": ws,
                                  "context_mib": round(host.footprint().context_bytes / MB),
                                  "load_mib": round((loaded - before) / MB), "after_requests_mib": round((served - before) / MB),
                                  "load_ms": round(host.load_ms or 0)}), flush=True)
                host.unload()
                print(json.dumps({"unloaded_left_mib": round((process_gpu_bytes().bytes - before) / MB)}), flush=True)


if __name__ == "__main__":
    main()
