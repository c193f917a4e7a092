"""Config completion from the model file (``runtime.contract.completion``): a folder holding only
``1/model.onnx``, or a ``config.yaml`` that leaves out inputs/outputs/max_batch_size, is completed
from the ONNX graph; what a config says is checked against the graph at read, with one line
naming the config file, the field and the model file."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper

from deployments.runtime.contract.completion import DEFAULT_MAX_BATCH_SIZE, completed_fields
from deployments.runtime.contract.config import CacheOptions, Profile, read_config_file
from deployments.runtime.contract.errors import ConfigError, InvalidInput, InvalidModelFile, LoadFault, ModelNotFound
from deployments.runtime.contract.repository import ModelRepository
from deployments.runtime.residency.cache import ModelCache

F32, I64, I32, F16 = TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32, TensorProto.FLOAT16


def model_file(path: Path, inputs: list[tuple], outputs: list[tuple], nodes: list | None = None,
               version: int = 1) -> Path:
    """``path/<version>/model.onnx`` with ``inputs``/``outputs`` as (name, elem type, dims) and
    ``nodes`` (default: output i = Identity(input i))."""
    if nodes is None:
        nodes = [helper.make_node("Identity", [i[0]], [o[0]]) for i, o in zip(inputs, outputs)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(*t) for t in inputs],
                              [helper.make_tensor_value_info(*t) for t in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    target = path / str(version) / "model.onnx"
    target.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, target)
    return target


def write_config(folder: Path, **fields) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(fields, sort_keys=False))
    return folder / "config.yaml"


def encoder(folder: Path, version: int = 1) -> Path:
    """A text encoder's signature: INT64 ``input_ids`` and ``attention_mask`` [batch, seq] ->
    FP32 ``hidden`` [batch, seq] (their sum, cast)."""
    nodes = [helper.make_node("Add", ["input_ids", "attention_mask"], ["sum"]),
             helper.make_node("Cast", ["sum"], ["hidden"], to=F32)]
    return model_file(folder, [("input_ids", I64, ["batch", "seq"]), ("attention_mask", I64, ["batch", "seq"])],
                      [("hidden", F32, ["batch", "seq"])], nodes, version)


def only(root: Path, name: str):
    return ModelRepository(root).get(name).config


# --- completion --------------------------------------------------------------------------------

def test_a_folder_with_only_a_model_file_is_served_with_its_symbolic_batch_axis(tmp_path):
    model_file(tmp_path / "cnn", [("x", F32, ["N", 3, 8, 8])], [("y", F32, ["N", 3, 8, 8])])
    config = only(tmp_path, "cnn")
    assert config.max_batch_size == DEFAULT_MAX_BATCH_SIZE == 4
    [x], [y] = config.inputs, config.outputs
    assert (x.name, x.datatype, x.dims) == ("x", "FP32", (-1, 3, 8, 8))
    assert x.profile == Profile(min=(1, 3, 8, 8), opt=(4, 3, 8, 8), max=(4, 3, 8, 8))
    assert (y.name, y.datatype, y.dims, y.profile) == ("y", "FP32", (-1, 3, 8, 8), None)


def test_axis_0_without_one_symbol_in_every_tensor_is_no_batch_axis(tmp_path):
    # input and output name axis 0 differently: no batch axis; axis 0 is a dynamic axis like any other
    model_file(tmp_path / "m", [("x", F32, ["N", 4])], [("y", F32, ["M", 4])])
    config = only(tmp_path, "m")
    assert config.max_batch_size == 0
    assert config.inputs[0].dims == (-1, 4)
    assert config.inputs[0].profile == Profile(min=(1, 4), opt=(128, 4), max=(1024, 4))
    # an axis 0 without a symbol is no shared symbol either; a fixed axis 0 neither
    model_file(tmp_path / "unnamed", [("x", F32, [None, 4])], [("y", F32, [None, 4])])
    model_file(tmp_path / "fixed", [("x", F32, [2, 4])], [("y", F32, [2, 4])])
    repo = ModelRepository(tmp_path)
    assert repo.get("unnamed").config.max_batch_size == 0
    fixed = repo.get("fixed").config
    assert (fixed.max_batch_size, fixed.inputs[0].dims, fixed.inputs[0].profile) == (0, (2, 4), None)


def test_a_shared_symbolic_sequence_axis_gets_the_default_profile_which_the_config_may_override(tmp_path):
    encoder(tmp_path / "enc")
    config = only(tmp_path, "enc")
    assert config.max_batch_size == 4
    assert [(t.name, t.datatype, t.dims) for t in config.inputs] == [
        ("input_ids", "INT64", (-1, -1)), ("attention_mask", "INT64", (-1, -1))]
    assert {t.profile for t in config.inputs} == {Profile(min=(1, 1), opt=(4, 128), max=(4, 1024))}
    assert [(t.name, t.datatype, t.dims) for t in config.outputs] == [("hidden", "FP32", (-1, -1))]

    write_config(tmp_path / "enc", max_batch_size=16, default_profile={"opt": 64, "max": 256})
    config = only(tmp_path, "enc")
    assert {t.profile for t in config.inputs} == {Profile(min=(1, 1), opt=(16, 64), max=(16, 256))}


def test_fp16_and_several_outputs_are_completed_in_the_files_order(tmp_path):
    nodes = [helper.make_node("Identity", ["x"], ["first"]), helper.make_node("Neg", ["x"], ["second"]),
             helper.make_node("Shape", ["x"], ["third"])]
    model_file(tmp_path / "multi", [("x", F16, ["N", 2])],
               [("first", F16, ["N", 2]), ("second", F16, ["N", 2]), ("third", I64, [2])], nodes)
    config = only(tmp_path, "multi")
    assert config.max_batch_size == 0  # 'third' has no axis 'N': no batch axis
    assert [(t.name, t.datatype, t.dims) for t in config.outputs] == [
        ("first", "FP16", (-1, 2)), ("second", "FP16", (-1, 2)), ("third", "INT64", (2,))]
    assert config.inputs[0].datatype == "FP16"


def test_a_config_leaving_out_only_outputs_gets_them_and_keeps_its_inputs(tmp_path):
    encoder(tmp_path / "enc")
    profile = {"min": [1, 1], "opt": [2, 16], "max": [8, 64]}
    write_config(tmp_path / "enc", max_batch_size=8, inputs=[
        {"name": "input_ids", "datatype": "INT64", "dims": [-1, -1], "profile": profile},
        {"name": "attention_mask", "datatype": "INT64", "dims": [-1, -1]}])
    config = only(tmp_path, "enc")
    assert config.inputs[0].profile == Profile(**profile)  # its own profile stands
    assert config.inputs[1].profile == Profile(min=(1, 1), opt=(8, 128), max=(8, 1024))  # the default
    assert [t.name for t in config.outputs] == ["hidden"]
    given = read_config_file(tmp_path / "enc" / "config.yaml")
    assert completed_fields(given, config) == {
        "outputs": [{"name": "hidden", "datatype": "FP32", "dims": [-1, -1]}],
        "inputs.1.profile": {"min": [1, 1], "opt": [8, 128], "max": [8, 1024]}}


def test_a_config_may_fix_a_dynamic_axis_set_max_batch_size_and_list_some_outputs(tmp_path):
    nodes = [helper.make_node("Identity", ["x"], ["a"]), helper.make_node("Neg", ["x"], ["b"])]
    model_file(tmp_path / "m", [("x", F32, ["N", "H"])], [("a", F32, ["N", "H"]), ("b", F32, ["N", "H"])], nodes)
    write_config(tmp_path / "m", max_batch_size=2, inputs=[{"name": "x", "datatype": "FP32", "dims": [-1, 5]}],
                 outputs=[{"name": "b", "datatype": "FP32", "dims": [-1, 5]}])
    config = only(tmp_path, "m")
    assert config.max_batch_size == 2 and config.inputs[0].profile == Profile(min=(1, 5), opt=(2, 5), max=(2, 5))
    assert [t.name for t in config.outputs] == ["b"]


def test_a_dynamic_sequence_axis_without_profile_serves_on_onnx_runtime_within_the_default_bound(tmp_path):
    # Seen by a tester: "dims [-1, -1] are dynamic and there is no profile giving their max" on every request.
    encoder(tmp_path / "enc")
    write_config(tmp_path / "enc", max_batch_size=4, backend="onnxruntime", inputs=[
        {"name": "input_ids", "datatype": "INT64", "dims": [-1, -1]},
        {"name": "attention_mask", "datatype": "INT64", "dims": [-1, -1]}])
    cache = ModelCache(ModelRepository(tmp_path), ["enc"], CacheOptions(load_policy="lazy")).start()
    try:
        ids, mask = np.arange(14, dtype=np.int64).reshape(2, 7), np.ones((2, 7), np.int64)
        out = cache.infer("enc", {"input_ids": ids, "attention_mask": mask})
        np.testing.assert_array_equal(out["hidden"], (ids + mask).astype(np.float32))
        with pytest.raises(InvalidInput, match=r"input 'input_ids': axis 1 is 1025, allowed \[1, 1024\]"):
            cache.infer("enc", {"input_ids": np.ones((1, 1025), np.int64), "attention_mask": np.ones((1, 1025), np.int64)})
    finally:
        cache.close()


# --- what must match the file ------------------------------------------------------------------

def test_a_datatype_other_than_the_files_is_a_config_error_naming_file_field_and_model_file(tmp_path):
    # Seen by a tester: INT32 in the config, INT64 in the file: check said OK, every request 500.
    encoder(tmp_path / "enc")
    path = write_config(tmp_path / "enc", inputs=[{"name": "input_ids", "datatype": "INT64", "dims": [-1, -1]},
                                                   {"name": "attention_mask", "datatype": "INT32", "dims": [-1, -1]}])
    with pytest.raises(ConfigError) as raised:
        ModelRepository(tmp_path)
    assert raised.value.message == (
        f"{path}: inputs.1.datatype: INT32, but {tmp_path / 'enc' / '1' / 'model.onnx'} has input 'attention_mask' "
        "as INT64: the datatype must be the file's")


def test_an_output_rank_other_than_the_files_is_a_config_error(tmp_path):
    # Seen by a tester: answers came back with a shape contradicting the metadata.
    encoder(tmp_path / "enc")
    path = write_config(tmp_path / "enc", outputs=[{"name": "hidden", "datatype": "FP32", "dims": [-1, -1, 384]}])
    with pytest.raises(ConfigError) as raised:
        ModelRepository(tmp_path)
    assert raised.value.message == (
        f"{path}: outputs.0.dims: [-1, -1, 384] has rank 3, but {tmp_path / 'enc' / '1' / 'model.onnx'} has output "
        "'hidden' with rank 2 (dims [batch, seq]): the rank must be the file's")


def test_a_changed_fixed_axis_is_a_config_error(tmp_path):
    model_file(tmp_path / "m", [("x", F32, ["N", 3, 8])], [("y", F32, ["N", 3, 8])])
    path = write_config(tmp_path / "m", inputs=[{"name": "x", "datatype": "FP32", "dims": [-1, 3, 16]}])
    with pytest.raises(ConfigError) as raised:
        ModelRepository(tmp_path)
    assert raised.value.message == (
        f"{path}: inputs.0.dims: [-1, 3, 16], but {tmp_path / 'm' / '1' / 'model.onnx'} has input 'x' with axis 2 "
        "fixed to 8 (dims [N, 3, 8]): a config may fix a dynamic axis to a size, not change a fixed one")


def test_input_names_other_than_the_files_are_a_config_error(tmp_path):
    encoder(tmp_path / "enc")
    path = write_config(tmp_path / "enc", inputs=[{"name": "input_ids", "datatype": "INT64", "dims": [-1, -1]},
                                                  {"name": "token_type_ids", "datatype": "INT64", "dims": [-1, -1]}])
    with pytest.raises(ConfigError) as raised:
        ModelRepository(tmp_path)
    assert raised.value.message == (
        f"{path}: inputs: ['input_ids', 'token_type_ids'] are not the inputs of {tmp_path / 'enc' / '1' / 'model.onnx'}, "
        "['input_ids', 'attention_mask'] (missing ['attention_mask'], not in the file ['token_type_ids']): list "
        "every input of the file, or leave inputs out to take them from it")


def test_an_output_not_in_the_file_is_a_config_error(tmp_path):
    encoder(tmp_path / "enc")
    path = write_config(tmp_path / "enc", outputs=[{"name": "pooled", "datatype": "FP32", "dims": [-1, 384]}])
    with pytest.raises(ConfigError) as raised:
        ModelRepository(tmp_path)
    assert raised.value.message == (
        f"{path}: outputs: ['pooled'] are not outputs of {tmp_path / 'enc' / '1' / 'model.onnx'}, whose outputs are "
        "['hidden']: list some of them, or leave outputs out to take them all")


def test_max_batch_size_over_a_fixed_axis_0_is_a_config_error(tmp_path):
    model_file(tmp_path / "m", [("x", F32, [1, 4])], [("y", F32, [1, 4])])
    path = write_config(tmp_path / "m", max_batch_size=8)
    with pytest.raises(ConfigError) as raised:
        ModelRepository(tmp_path)
    assert raised.value.message == (
        f"{path}: max_batch_size: 8 makes axis 0 the batch axis, but {tmp_path / 'm' / '1' / 'model.onnx'} has input "
        "'x' with axis 0 fixed to 1 (dims [1, 4]): a batched model's axis 0 is dynamic in every input and output; "
        "set max_batch_size: 0")


def test_every_served_version_is_checked_against_the_config(tmp_path):
    model_file(tmp_path / "m", [("x", F32, ["N", 4])], [("y", F32, ["N", 4])], version=1)
    model_file(tmp_path / "m", [("x", I32, ["N", 4])], [("y", I32, ["N", 4])], version=2)
    path = write_config(tmp_path / "m", version_policy={"all": {}})
    with pytest.raises(ConfigError) as raised:  # completed from version 2 (the newest), version 1 disagrees
        ModelRepository(tmp_path)
    assert raised.value.message.startswith(
        f"{path}: inputs.0.datatype: INT32, but {tmp_path / 'm' / '1' / 'model.onnx'} has input 'x' as FP32")
    write_config(tmp_path / "m")  # latest only: version 1 is not served
    assert only(tmp_path, "m").inputs[0].datatype == "INT32"


def test_what_the_file_cannot_tell_is_a_config_error_naming_what_to_write(tmp_path):
    model_file(tmp_path / "m", [("x", F32, None)], [("y", F32, None)])
    with pytest.raises(ConfigError) as raised:
        ModelRepository(tmp_path)
    assert raised.value.message == (  # no config.yaml there: none is named as if it were
        f"m (no config.yaml): inputs are read from its model file, and {tmp_path / 'm' / '1' / 'model.onnx'} has "
        "input 'x' without a shape: list the inputs with their dims in a config.yaml")
    model_file(tmp_path / "b", [("x", TensorProto.BFLOAT16, ["N"])], [("y", TensorProto.BFLOAT16, ["N"])])
    write_config(tmp_path / "b")
    with pytest.raises(ConfigError, match=r"b/config.yaml: inputs: left out, and .* has input 'x' of type "
                                          r"tensor\(bfloat16\), which has no KServe v2 datatype \(allowed: BOOL, "):
        ModelRepository(tmp_path, ["b"])


def test_a_damaged_model_file_is_invalid_only_when_the_config_needs_completing(tmp_path):
    """The file's content is its owner's as a config is: 400 through model control
    (``InvalidModelFile``; at start it stops the start as a config error does,
    ``deployments.app``), naming the model file, not the config it completes."""
    encoder(tmp_path / "enc").write_bytes(b"not onnx at all")
    with pytest.raises(InvalidModelFile) as raised:
        ModelRepository(tmp_path)
    assert raised.value.message == ("model 'enc': its model file enc/1/model.onnx is not a valid ONNX model: it does "
                                    "not parse as one (damaged, truncated or another format)")
    # a complete config is indexed: the damaged file is reported when the model loads (tests/unit/test_faults.py)
    write_config(tmp_path / "enc", max_batch_size=0,
                 inputs=[{"name": "input_ids", "datatype": "INT64", "dims": [2]}],
                 outputs=[{"name": "hidden", "datatype": "FP32", "dims": [2]}])
    assert ModelRepository(tmp_path).names() == ["enc"]


# --- the repository indexes folders without config.yaml ------------------------------------------

def test_a_folder_without_config_yaml_added_after_start_is_read_and_an_empty_folder_is_no_model(
        prepared_engines, tmp_path):
    shutil.copytree(prepared_engines / "simple", tmp_path / "simple")
    (tmp_path / "empty").mkdir()
    repo = ModelRepository(tmp_path)
    assert repo.names() == ["simple"] and repo.folders() == ["simple"]
    (tmp_path / "late" / "1").mkdir(parents=True)
    shutil.copy(prepared_engines / "tiny_cnn" / "1" / "model.onnx", tmp_path / "late" / "1" / "model.onnx")
    assert repo.folders() == ["late", "simple"]
    entry = repo.read("late")
    assert (entry.config.max_batch_size, entry.config.inputs[0].dims) == (4, (-1, 3, 224, 224))
    assert repo.names() == ["late", "simple"]
    with pytest.raises(ModelNotFound) as raised:
        repo.read("empty")
    assert raised.value.message == (
        "no model folder 'empty' with a config.yaml or a <version>/model.onnx in the model repository; folders: "
        "['late', 'simple']")
