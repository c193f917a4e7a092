"""A Triton model folder (``config.pbtxt`` beside ``1/model.onnx``) serves with Triton's meaning
(``runtime.contract.triton_config``): real Triton configs mapped to this server's ModelConfig,
refused fields with their one-line errors, ``reshape`` run on ONNX Runtime."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import yaml
from google.protobuf import json_format
from onnx import TensorProto, helper, numpy_helper
from tritonclient.grpc import model_config_pb2

from deployments.protocol.triton import model_configuration
from deployments.runtime.contract.config import DynamicBatching, Profile, TensorSpec, VersionPolicy
from deployments.runtime.contract.errors import ConfigError, InvalidInput
from deployments.runtime.contract.repository import ModelRepository
from deployments.runtime.residency.host import ModelHost

F32, I32 = TensorProto.FLOAT, TensorProto.INT32

# Triton's quickstart model, docs/examples/model_repository/densenet_onnx/config.pbtxt as in
# github.com/triton-inference-server/server.
DENSENET_PBTXT = """\
name: "densenet_onnx"
platform: "onnxruntime_onnx"
max_batch_size : 0
input [
  {
    name: "data_0"
    data_type: TYPE_FP32
    format: FORMAT_NCHW
    dims: [ 3, 224, 224 ]
    reshape { shape: [ 1, 3, 224, 224 ] }
  }
]
output [
  {
    name: "fc6_1"
    data_type: TYPE_FP32
    dims: [ 1000 ]
    reshape { shape: [ 1, 1000, 1, 1 ] }
    label_filename: "densenet_labels.txt"
  }
]
"""

# docs/examples/model_repository/simple/config.pbtxt (its license header left out).
SIMPLE_PBTXT = """\
name: "simple"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [
  {
    name: "INPUT0"
    data_type: TYPE_INT32
    dims: [ 16 ]
  },
  {
    name: "INPUT1"
    data_type: TYPE_INT32
    dims: [ 16 ]
  }
]
output [
  {
    name: "OUTPUT0"
    data_type: TYPE_INT32
    dims: [ 16 ]
  },
  {
    name: "OUTPUT1"
    data_type: TYPE_INT32
    dims: [ 16 ]
  }
]
"""

# docs/examples/model_repository/simple_sequence/config.pbtxt
SIMPLE_SEQUENCE_PBTXT = """\
name: "simple_sequence"
platform: "onnxruntime_onnx"
max_batch_size: 8
sequence_batching {
  control_input [
    {
      name: "START"
      control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ]
    }
  ]
}
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU } ]
"""


def save(model: onnx.ModelProto, path: Path) -> Path:
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, path)
    return path


def densenet_like(folder: Path, channels: int = 3, size: int = 224, classes: int = 1000) -> Path:
    """``folder/1/model.onnx``: ``data_0`` FP32 [1, C, S, S] -> global average pool -> 1x1 conv
    -> ``fc6_1`` FP32 [1, classes, 1, 1] (densenet's signature, seeded weights)."""
    weights = np.random.default_rng(0).standard_normal((classes, channels, 1, 1)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("GlobalAveragePool", ["data_0"], ["pooled"]),
         helper.make_node("Conv", ["pooled", "w"], ["fc6_1"])], "densenet_like",
        [helper.make_tensor_value_info("data_0", F32, [1, channels, size, size])],
        [helper.make_tensor_value_info("fc6_1", F32, [1, classes, 1, 1])], [numpy_helper.from_array(weights, "w")])
    return save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), folder / "1" / "model.onnx")


def simple_like(folder: Path, batch: str | int = "N") -> Path:
    """Triton's ``simple``: INT32 INPUT0, INPUT1 [batch, 16] -> OUTPUT0 = sum, OUTPUT1 = difference."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
         helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"])], "simple",
        [helper.make_tensor_value_info(n, I32, [batch, 16]) for n in ("INPUT0", "INPUT1")],
        [helper.make_tensor_value_info(n, I32, [batch, 16]) for n in ("OUTPUT0", "OUTPUT1")])
    return save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), folder / "1" / "model.onnx")


def folder_with(root: Path, name: str, pbtxt: str, model=simple_like) -> Path:
    model(root / name)
    (root / name / "config.pbtxt").write_text(pbtxt)
    return root / name


def config_of(root: Path, name: str):
    return ModelRepository(root).get(name).config


def notes_of(folder: Path) -> tuple[str, ...]:
    """The notes on what the folder's config file said and is ignored."""
    from deployments.runtime.contract.repository import read_folder_config

    return read_folder_config(folder).notes


def error_of(root: Path, name: str) -> str:
    with pytest.raises(ConfigError) as e:
        ModelRepository(root, [name])
    return str(e.value)


# --- mapping real Triton configs --------------------------------------------------------------

def test_densenet_onnx_config_maps_to_its_dims_with_the_model_files_shape_as_reshape(tmp_path):
    folder_with(tmp_path, "densenet_onnx", DENSENET_PBTXT, densenet_like)
    config = config_of(tmp_path, "densenet_onnx")
    assert (config.name, config.backend, config.max_batch_size, config.instances) == ("densenet_onnx", "auto", 0, 1)
    assert config.inputs == (TensorSpec(name="data_0", datatype="FP32", dims=(3, 224, 224), reshape=(1, 3, 224, 224)),)
    assert config.outputs == (TensorSpec(name="fc6_1", datatype="FP32", dims=(1000,), reshape=(1, 1000, 1, 1)),)
    assert notes_of(tmp_path / "densenet_onnx") == (
        f"{tmp_path}/densenet_onnx/config.pbtxt: output[0].label_filename: ignored: classification answers carry "
        "'value:index' without labels here",)


def test_densenet_onnx_runs_the_reshaped_input_and_answers_in_the_configs_dims(tmp_path):
    folder_with(tmp_path, "densenet_onnx", DENSENET_PBTXT, densenet_like)
    host = ModelHost(ModelRepository(tmp_path).get("densenet_onnx"), backend="onnxruntime").load()
    x = np.random.default_rng(1).standard_normal((3, 224, 224)).astype(np.float32)
    got = host.infer({"data_0": x})["fc6_1"]
    session = ort.InferenceSession(str(tmp_path / "densenet_onnx/1/model.onnx"), providers=["CPUExecutionProvider"])
    want = session.run(None, {"data_0": x.reshape(1, 3, 224, 224)})[0]
    assert got.shape == (1000,)
    np.testing.assert_array_equal(got, want.reshape(1000))
    with pytest.raises(InvalidInput, match=r"input 'data_0'.*\[1, 3, 224, 224\]"):  # the client's shape is dims
        host.infer({"data_0": x.reshape(1, 3, 224, 224)})
    host.unload()


def test_simple_config_takes_dims_without_the_batch_axis_as_triton_means_them(tmp_path):
    folder_with(tmp_path, "simple", SIMPLE_PBTXT)
    config = config_of(tmp_path, "simple")
    assert config.max_batch_size == 8 and config.backend == "auto" and config.deployment.mode == "pool"
    assert [(t.name, t.datatype, t.dims) for t in config.inputs + config.outputs] == [
        ("INPUT0", "INT32", (-1, 16)), ("INPUT1", "INT32", (-1, 16)),
        ("OUTPUT0", "INT32", (-1, 16)), ("OUTPUT1", "INT32", (-1, 16))]
    assert config.inputs[0].profile == Profile(min=(1, 16), opt=(8, 16), max=(8, 16))  # completed as without config


def test_max_batch_size_0_with_listed_tensors_keeps_a_dynamic_axis_0_unbatched(tmp_path):
    # The fault this serves: completion made axis 0 a batch axis of at most 4, and 16 rows were refused.
    folder_with(tmp_path, "m", SIMPLE_PBTXT.replace("simple", "m").replace("max_batch_size: 8", "max_batch_size: 0")
                .replace("dims: [ 16 ]", "dims: [ -1, 16 ]"))
    config = config_of(tmp_path, "m")
    assert config.max_batch_size == 0 and config.inputs[0].dims == (-1, 16)
    host = ModelHost(ModelRepository(tmp_path).get("m"), backend="onnxruntime").load()
    a, b = np.arange(256, dtype=np.int32).reshape(16, 16), np.ones((16, 16), np.int32)
    out = host.infer({"INPUT0": a, "INPUT1": b})
    np.testing.assert_array_equal(out["OUTPUT0"], a + b)
    host.unload()


def test_a_config_listing_no_tensors_is_completed_from_the_file_as_tritons_auto_complete(tmp_path):
    folder_with(tmp_path, "m", 'platform: "onnxruntime_onnx"\nmax_batch_size: 0\ninstance_group [ { count: 2 } ]\n')
    config = config_of(tmp_path, "m")
    assert config.max_batch_size == 4  # Triton's default-max-batch-size for a batchable file
    assert config.instances == 2  # and the rest of the file is read
    assert [t.dims for t in config.inputs] == [(-1, 16), (-1, 16)]


def test_batching_instances_versions_and_warmup_map_to_this_servers_fields(tmp_path):
    folder_with(tmp_path, "m", SIMPLE_PBTXT.replace('name: "simple"\n', "") + """
dynamic_batching { preferred_batch_size: [ 4, 8 ] max_queue_delay_microseconds: 2500 preserve_ordering: true }
instance_group [ { count: 2 kind: KIND_CPU }, { kind: KIND_CPU gpus: [ 0 ] } ]
version_policy: { all { } }
default_model_filename: "model.onnx"
parameters: { key: "intra_op_thread_count" value: { string_value: "2" } }
model_warmup [ { name: "zeros" batch_size: 2 inputs { key: "INPUT0" value: { data_type: TYPE_INT32 dims: [ 16 ]
  zero_data: true } } inputs { key: "INPUT1" value: { data_type: TYPE_INT32 dims: [ 16 ] zero_data: true } } } ]
response_cache { enable: true }
""")
    config = config_of(tmp_path, "m")
    assert config.name == "m" and config.backend == "onnxruntime" and config.instances == 3
    assert config.dynamic_batching == DynamicBatching(preferred_batch_size=(4, 8), max_queue_delay_ms=2.5)
    assert config.deployment.mode == "dedicated"  # where this server batches
    assert config.version_policy == VersionPolicy(all={})
    assert config.parameters == {"intra_op_thread_count": "2"}
    assert (config.warmup.batch_sizes, config.warmup.data) == ((2,), "zeros")
    path = tmp_path / "m" / "config.pbtxt"
    assert notes_of(tmp_path / "m") == (
        f"{path}: response_cache: ignored: no response cache: every request runs the model",
        f"{path}: instance_group[1]: gpus: ignored: Ray Serve places the replicas and their GPUs (deployment in "
        "docs/configuration.md)",
        f"{path}: dynamic_batching: preserve_ordering: ignored: requests are served in arrival order with the "
        "server's own queue limits (docs/reliability.md)",
        f"{path}: parameters: ['intra_op_thread_count'] are shown in the model's configuration and not acted on "
        "(backend settings of Triton's)")


@pytest.mark.parametrize("lines, backend, instances", [
    ('platform: "onnxruntime_onnx"\ninstance_group [ { kind: KIND_GPU } ]', "onnxruntime_cuda", 1),
    ('backend: "onnxruntime"\ninstance_group [ { kind: KIND_AUTO count: 2 } ]', "auto", 2),
    ('platform: "tensorrt_plan"', "tensorrt", 1),
    ('backend: "tensorrt"\ninstance_group [ { kind: KIND_GPU count: 3 } ]', "tensorrt", 3),
])
def test_platform_and_instance_kind_pick_the_backend(tmp_path, lines, backend, instances):
    folder_with(tmp_path, "m", SIMPLE_PBTXT.replace('name: "simple"\nplatform: "onnxruntime_onnx"\n', lines + "\n"))
    config = config_of(tmp_path, "m")
    assert (config.backend, config.instances) == (backend, instances)


def test_the_configuration_route_gives_the_reshape_back_and_parses_as_tritons(tmp_path):
    folder_with(tmp_path, "densenet_onnx", DENSENET_PBTXT, densenet_like)
    shown = model_configuration(config_of(tmp_path, "densenet_onnx"), "onnxruntime")
    parsed = json_format.ParseDict(json.loads(json.dumps(shown)), model_config_pb2.ModelConfig())
    assert list(parsed.input[0].dims) == [3, 224, 224] and list(parsed.input[0].reshape.shape) == [1, 3, 224, 224]
    assert list(parsed.output[0].dims) == [1000] and list(parsed.output[0].reshape.shape) == [1, 1000, 1, 1]


def test_a_batched_reshape_applies_per_batch_item(tmp_path):
    # the model takes [N, 1, 16] and gives [N, 1, 16]: the client sends and gets [N, 16]
    graph = helper.make_graph([helper.make_node("Neg", ["x"], ["y"])], "neg",
                              [helper.make_tensor_value_info("x", F32, ["N", 1, 16])],
                              [helper.make_tensor_value_info("y", F32, ["N", 1, 16])])
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "neg" / "1" / "model.onnx")
    (tmp_path / "neg" / "config.pbtxt").write_text(
        "max_batch_size: 4\ninput [ { name: \"x\" data_type: TYPE_FP32 dims: [ 16 ] reshape { shape: [ 1, 16 ] } } ]\n"
        "output [ { name: \"y\" data_type: TYPE_FP32 dims: [ 16 ] reshape { shape: [ 1, 16 ] } } ]\n")
    entry = ModelRepository(tmp_path).get("neg")
    assert entry.config.inputs[0].dims == (-1, 16) and entry.config.inputs[0].reshape == (-1, 1, 16)
    from deployments.runtime.contract.reshape import engine_config

    # the backends (and a TensorRT plan's profile) see the file's shape, the batch axis kept
    model_side = engine_config(entry.config).inputs[0]
    assert (model_side.dims, model_side.reshape) == ((-1, 1, 16), None)
    assert model_side.profile == Profile(min=(1, 1, 16), opt=(4, 1, 16), max=(4, 1, 16))
    host = ModelHost(entry, backend="onnxruntime").load()
    x = np.arange(48, dtype=np.float32).reshape(3, 16)
    np.testing.assert_array_equal(host.infer({"x": x})["y"], -x)
    host.warm([1, 4])  # zeros of the client's shape, run in the file's
    host.unload()


# --- refused and wrong configs: one line naming the file and the field ------------------------

@pytest.mark.parametrize("field, message", [
    ('platform: "pytorch_libtorch"', "platform: 'pytorch_libtorch' is not served here; supported: platform "
     "onnxruntime_onnx or tensorrt_plan, backend onnxruntime or tensorrt (the model in <version>/model.onnx)"),
    ('backend: "python"', "backend: 'python' is not served here; supported: platform onnxruntime_onnx or "
     "tensorrt_plan, backend onnxruntime or tensorrt (the model in <version>/model.onnx)"),
    ('platform: "tensorflow_savedmodel"', "platform: 'tensorflow_savedmodel' is not served here"),
    ('platform: "ensemble"', "platform: 'ensemble' is not served here"),
    ('platform: "onnxruntime_onnx"\nbackend: "tensorrt"', "platform: 'onnxruntime_onnx' and backend: 'tensorrt' "
     "name different model kinds"),
    ('model_transaction_policy { decoupled: true }', "model_transaction_policy.decoupled: true: decoupled models "
     "(zero or many responses per request) are not supported: each request gets one response here"),
    ('default_model_filename: "simple.onnx"', "default_model_filename: 'simple.onnx': this server reads "
     "<version>/model.onnx (and builds TensorRT plans from it); name the file model.onnx and drop the field"),
    ('ensemble_scheduling { step [ ] }\nplatform: "onnxruntime_onnx"', "ensemble_scheduling: ensembles are not "
     "supported: a pipeline model composes models here (docs/models.md); remove it to serve the model here"),
    ('instance_group [ { kind: KIND_CPU }, { kind: KIND_GPU } ]', "instance_group: kinds ['KIND_CPU', 'KIND_GPU'] "
     "differ: a model's instances run on one backend here; give one kind"),
    ('platform: "tensorrt_plan"\ninstance_group [ { kind: KIND_CPU } ]', "instance_group.kind: KIND_CPU, but a "
     "TensorRT plan runs on a GPU"),
])
def test_unsupported_platforms_and_fields_are_config_errors_naming_them(tmp_path, field, message):
    folder_with(tmp_path, "m", field + "\n")
    assert error_of(tmp_path, "m").startswith(f"{tmp_path}/m/config.pbtxt: {message}")


def test_tritons_sequence_example_is_refused_naming_sequence_batching(tmp_path):
    folder_with(tmp_path, "simple_sequence", SIMPLE_SEQUENCE_PBTXT)
    assert error_of(tmp_path, "simple_sequence") == (
        f"{tmp_path}/simple_sequence/config.pbtxt: sequence_batching: stateful sequence models are not supported: "
        "models here are stateless; remove it to serve the model here")


def test_tensor_errors_name_the_field_and_what_is_allowed(tmp_path):
    folder_with(tmp_path, "m", 'input [ { name: "INPUT0" data_type: TYPE_BF16 dims: [ 16 ] } ]\n')
    assert error_of(tmp_path, "m") == (
        f"{tmp_path}/m/config.pbtxt: input[0].data_type: TYPE_BF16; supported: TYPE_BOOL, TYPE_UINT8, TYPE_UINT16, "
        "TYPE_UINT32, TYPE_UINT64, TYPE_INT8, TYPE_INT16, TYPE_INT32, TYPE_INT64, TYPE_FP16, TYPE_FP32, TYPE_FP64, "
        "TYPE_STRING")
    (tmp_path / "m" / "config.pbtxt").write_text('input [ { name: "INPUT0" dims: [ 16 ] } ]\n')
    assert error_of(tmp_path, "m").startswith(f"{tmp_path}/m/config.pbtxt: input[0].data_type: missing; supported: ")
    (tmp_path / "m" / "config.pbtxt").write_text(
        'input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] is_shape_tensor: true } ]\n')
    assert error_of(tmp_path, "m") == (f"{tmp_path}/m/config.pbtxt: input[0].is_shape_tensor: true: TensorRT shape "
                                       "tensors are not supported")


def test_text_triton_cannot_parse_is_an_error_at_its_line_and_column(tmp_path):
    folder_with(tmp_path, "m", 'name: "m"\nmax_batch_sise: 8\n')
    assert error_of(tmp_path, "m") == (
        f"{tmp_path}/m/config.pbtxt:2:1: cannot read Triton's model configuration: Message type "
        "\"inference.ModelConfig\" has no field named \"max_batch_sise\".")


def test_a_name_other_than_the_folders_is_refused_as_for_config_yaml(tmp_path):
    folder_with(tmp_path, "m", SIMPLE_PBTXT)
    assert error_of(tmp_path, "m") == f"{tmp_path}/m/config.pbtxt: name: 'simple' must equal its folder name 'm'"


def test_the_config_is_checked_against_the_model_file_naming_fields_as_config_pbtxt_does(tmp_path):
    """A mismatch named the field as this server's config.yaml would (``inputs.0.dims: [-1, 9]``,
    the batch axis added), not as the config.pbtxt the user wrote (``input[0].dims: [9]``)."""
    # TYPE_FP32 where the file has INT32; dims of rank 1 after the batch axis against the file's [N, 16]
    folder_with(tmp_path, "m", SIMPLE_PBTXT.replace('name: "simple"\n', "").replace("TYPE_INT32", "TYPE_FP32", 1))
    assert error_of(tmp_path, "m") == (
        f"{tmp_path}/m/config.pbtxt: input[0].data_type: TYPE_FP32, but {tmp_path}/m/1/model.onnx has input 'INPUT0' "
        "as INT32: the datatype must be the file's")
    (tmp_path / "m" / "config.pbtxt").write_text(SIMPLE_PBTXT.replace('name: "simple"\n', "")
                                                 .replace("dims: [ 16 ]", "dims: [ 4, 4 ]", 1))
    assert error_of(tmp_path, "m").startswith(
        f"{tmp_path}/m/config.pbtxt: input[0].dims: [4, 4] has rank 3 with the batch axis, but "
        f"{tmp_path}/m/1/model.onnx has input 'INPUT0' with rank 2")
    (tmp_path / "m" / "config.pbtxt").write_text(SIMPLE_PBTXT.replace('name: "simple"\n', "")
                                                 .replace("dims: [ 16 ]", "dims: [ 9 ]", 1))
    assert error_of(tmp_path, "m").startswith(
        f"{tmp_path}/m/config.pbtxt: input[0].dims: [9], but {tmp_path}/m/1/model.onnx has input 'INPUT0' with "
        "axis 1 fixed to 16")
    # a reshape is what the file is checked against
    folder_with(tmp_path, "d", DENSENET_PBTXT.replace("densenet_onnx", "d").replace("[ 1, 1000, 1, 1 ]", "[ 1000, 1, 1 ]"),
                densenet_like)
    assert error_of(tmp_path, "d").startswith(f"{tmp_path}/d/config.pbtxt: output[0].reshape: [1000, 1, 1] has rank 3")


def test_a_reshape_must_keep_the_element_count(tmp_path):
    folder_with(tmp_path, "d", DENSENET_PBTXT.replace("densenet_onnx", "d").replace("dims: [ 1000 ]", "dims: [ 999 ]"),
                densenet_like)
    assert error_of(tmp_path, "d") == (
        f"{tmp_path}/d/config.pbtxt: (top level): Value error, outputs.0.reshape: [1, 1000, 1, 1] holds 1000 elements "
        "and dims [999] 999: a reshape keeps the element count")


# --- the folder ---------------------------------------------------------------------------------

def test_config_yaml_wins_over_config_pbtxt_and_a_note_says_so(tmp_path):
    folder = folder_with(tmp_path, "m", SIMPLE_PBTXT)  # its name 'simple' would be refused if it were read
    (folder / "config.yaml").write_text(yaml.safe_dump({"max_batch_size": 2}))
    assert config_of(tmp_path, "m").max_batch_size == 2
    assert notes_of(folder) == (
        f"{folder}/config.pbtxt: not read: {folder}/config.yaml is this server's config and wins (remove one of them "
        "to silence this)",)


def test_a_folder_with_only_config_pbtxt_is_found_and_a_plan_alone_is_refused_saying_why(tmp_path):
    (tmp_path / "p" / "1").mkdir(parents=True)
    (tmp_path / "p" / "1" / "model.plan").write_bytes(b"plan")
    (tmp_path / "p" / "config.pbtxt").write_text('platform: "tensorrt_plan"\n')
    assert error_of(tmp_path, "p") == (
        f"{tmp_path}/p: no <version>/model.onnx found; a TensorRT plan alone (1/model.plan) is not served: this "
        "server builds its plans from the model.onnx they come from (python -m deployments.runtime.tools.build); put "
        "it beside the plan")


def test_a_triton_folder_added_after_start_is_read_at_its_load_and_a_bad_one_is_refused(tmp_path):
    folder_with(tmp_path, "first", SIMPLE_PBTXT.replace('name: "simple"\n', ""))
    repository = ModelRepository(tmp_path)
    folder_with(tmp_path, "densenet_onnx", DENSENET_PBTXT, densenet_like)
    assert repository.read("densenet_onnx").config.inputs[0].reshape == (1, 3, 224, 224)
    folder_with(tmp_path, "seq", SIMPLE_SEQUENCE_PBTXT.replace("simple_sequence", "seq"))
    with pytest.raises(ConfigError, match=r"seq/config.pbtxt: sequence_batching: stateful sequence models"):
        repository.read("seq")
    assert repository.names() == ["densenet_onnx", "first"]


def test_make_check_shows_what_a_config_pbtxt_left_to_complete_and_what_it_ignored(tmp_path):
    import subprocess
    import sys

    from deployments.check import write

    root = Path(__file__).resolve().parents[2]
    folder_with(tmp_path / "engines", "densenet_onnx", DENSENET_PBTXT, densenet_like)
    config = yaml.safe_load((root / "serve_config.yaml").read_text())
    config["applications"] = config["applications"][:1]
    config["applications"][0]["args"].update(repository=str(tmp_path / "engines"))
    (tmp_path / "serve_config.yaml").write_text(yaml.safe_dump(config))
    write(tmp_path / "serve_config.yaml")  # the pool's application
    result = subprocess.run([sys.executable, "-m", "deployments.check", str(tmp_path / "serve_config.yaml")],
                            capture_output=True, text=True, cwd=root, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[1:] == [
        f"  densenet_onnx: {tmp_path}/engines/densenet_onnx/config.pbtxt: output[0].label_filename: ignored: "
        "classification answers carry 'value:index' without labels here"]
    (tmp_path / "engines" / "densenet_onnx" / "config.pbtxt").write_text(DENSENET_PBTXT.replace("TYPE_FP32", "TYPE_FP16", 1))
    result = subprocess.run([sys.executable, "-m", "deployments.check", str(tmp_path / "serve_config.yaml")],
                            capture_output=True, text=True, cwd=root, timeout=120)
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1] == (
        f"config error: {tmp_path}/engines/densenet_onnx/config.pbtxt: input[0].data_type: TYPE_FP16, but "
        f"{tmp_path}/engines/densenet_onnx/1/model.onnx has input 'data_0' as FP32: the datatype must be the file's")
