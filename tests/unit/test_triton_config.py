"""Triton's model configuration from config.yaml: it parses as Triton's own ModelConfig protobuf."""

from __future__ import annotations

import pytest
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2

from deployments.protocol.triton import TRITON_TYPES, model_configuration, platform_of
from deployments.runtime.contract.datatypes import NUMPY_BY_DATATYPE


def as_triton(config: dict) -> model_config_pb2.ModelConfig:
    """Parse with Triton's own schema: an unknown field or a wrong type raises ParseError."""
    return json_format.ParseDict(config, model_config_pb2.ModelConfig())


def test_every_datatype_has_a_triton_type_that_triton_knows():
    assert set(TRITON_TYPES) == set(NUMPY_BY_DATATYPE)
    assert all(name in model_config_pb2.DataType.keys() for name in TRITON_TYPES.values())


@pytest.mark.parametrize("backend", ["onnxruntime", "tensorrt"])
def test_every_model_config_parses_as_tritons_model_config(model_repository, backend):
    for entry in model_repository.entries():
        served = "pipeline" if entry.config.pipeline else backend
        parsed = as_triton(model_configuration(entry.config, served))
        assert parsed.name == entry.name and parsed.max_batch_size == entry.config.max_batch_size
        assert parsed.platform == platform_of(served)


def test_batched_model_dims_leave_out_the_batch_axis_and_batching_is_in_microseconds(model_repository):
    shipped = model_repository.get("ocr_cls").config
    assert "dynamic_batching" not in model_configuration(shipped, "onnxruntime")  # shipped with batching off
    batching = shipped.dynamic_batching.model_copy(update={"enabled": True})
    config = model_configuration(shipped.model_copy(update={"dynamic_batching": batching}), "onnxruntime")
    assert config["platform"] == "onnxruntime_onnx" and config["backend"] == "onnxruntime"
    assert config["max_batch_size"] == 32
    assert config["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": [3, 48, 192]}]
    assert config["dynamic_batching"] == {"preferred_batch_size": [8], "max_queue_delay_microseconds": 2000}
    assert config["instance_group"] == [{"name": "ocr_cls", "kind": "KIND_CPU", "count": 1}]


def test_tensorrt_instances_are_on_the_gpu_and_a_pipeline_is_an_ensemble(model_repository):
    trt = model_configuration(model_repository.get("tiny_cnn").config, "tensorrt")
    assert (trt["platform"], trt["instance_group"][0]["kind"], trt["instance_group"][0]["count"]) == (
        "tensorrt_plan", "KIND_GPU", 2)
    assert "dynamic_batching" not in trt
    ocr = model_configuration(model_repository.get("ocr").config, "pipeline")
    assert (ocr["platform"], ocr["backend"], ocr["max_batch_size"]) == ("ensemble", "", 0)
    assert "instance_group" not in ocr
    assert ocr["input"] == [{"name": "image", "data_type": "TYPE_STRING", "dims": [1]}]
