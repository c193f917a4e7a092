"""Model configs parse once into typed objects; a bad one names its file and field."""

from __future__ import annotations

from pathlib import Path

import pytest

from deployments.runtime.contract.config import load_model_config
from deployments.runtime.contract.errors import ConfigError, ModelNotFound
from deployments.runtime.contract.repository import ModelRepository

ROOT = Path(__file__).resolve().parents[2]
GOOD = """
max_batch_size: 8
instances: 2
inputs:
  - name: x
    datatype: FP32
    dims: [-1, 4]
    profile: {min: [1, 4], opt: [2, 4], max: [8, 4]}
outputs:
  - {name: y, datatype: FP32, dims: [-1, 2]}
deployment: {mode: dedicated, num_gpus: 0.25, autoscaling: {min_replicas: 1, max_replicas: 4}}
"""


def write(tmp_path: Path, text: str, name: str = "m") -> Path:
    (tmp_path / name).mkdir(exist_ok=True)
    path = tmp_path / name / "config.yaml"
    path.write_text(text)
    return path


def test_good_config_parses_into_frozen_typed_objects(tmp_path):
    config = load_model_config(write(tmp_path, GOOD))
    assert config.name == "m" and config.instances == 2
    assert config.inputs[0].bounds() == ((1, 4), (8, 4))
    assert config.deployment.num_gpus == 0.25 and config.deployment.autoscaling.max_replicas == 4
    with pytest.raises(Exception):
        config.instances = 3


@pytest.mark.parametrize("change,field", [
    (("FP32", "FP31"), "inputs.0.datatype"),
    (("instances: 2", "instances: 0"), "instances"),
    (("max: [8, 4]", "max: [0, 4]"), "inputs.0.profile"),
    (("opt: [2, 4]", "opt: [9, 4]"), "inputs.0.profile"),
    (("max_batch_size: 8", "max_batch_size: 16"), "max_batch_size 16 exceeds input 'x'"),
    (("mode: dedicated", "mode: hot"), "deployment.mode"),
    (("max_replicas: 4}", "max_replicas: 4, initial_replicas: 5}"), "need min_replicas <= initial_replicas"),
    (("instances: 2", "instanses: 2"), "instanses"),
    (("mode: dedicated", "mode: dedicated, max_queued_requests: 0"), "max_queued_requests must be -1"),
    (("dims: [-1, 4]", "dims: [-1, 0]"), "inputs.0"),
    (("dims: [-1, 4]", "dims: [-1, 4]\n    multiple_of: [1]"), "multiple_of needs one positive integer per axis"),
    (("min: [1, 4], opt: [2, 4], max: [8, 4]", "min: [1, 5], opt: [2, 5], max: [8, 5]"), "fixed dim 4"),
])
def test_bad_config_fails_naming_file_and_field(tmp_path, change, field):
    path = write(tmp_path, GOOD.replace(*change))
    with pytest.raises(ConfigError) as err:
        load_model_config(path)
    assert str(path) in err.value.message and field in err.value.message


def test_name_must_match_folder_and_yaml_must_parse(tmp_path):
    with pytest.raises(ConfigError, match="must equal its folder name 'm'"):
        load_model_config(write(tmp_path, "name: other\n" + GOOD))
    with pytest.raises(ConfigError, match="cannot read YAML"):
        load_model_config(write(tmp_path, "inputs: [\n"))


@pytest.mark.parametrize("text, where, problem", [
    ("max_batch_size: 8\n backend: auto\n", "2:9", "mapping values are not allowed here"),
    ("inputs:\n  - name: x\n    dims: [1, 2\n", "4:1", "expected ',' or ']', but got '<stream end>' (while "
                                                      "parsing a flow sequence at line 3)"),
])
def test_a_yaml_syntax_error_names_the_files_own_line_and_column_in_one_line(tmp_path, text, where, problem):
    """It named the file, then PyYAML's ``"<unicode string>", line 1`` over several lines."""
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_model_config(path)
    assert err.value.message == f"{path}:{where}: cannot read YAML: {problem}"


def test_repository_without_model_file_says_how_to_prepare(tmp_path):
    write(tmp_path, GOOD)
    with pytest.raises(ConfigError, match="make models"):
        ModelRepository(tmp_path)


def test_real_repository_indexes_every_model_and_version():
    repo = ModelRepository(ROOT / "engines")
    assert repo.names() == ["all-MiniLM-L6-v2", "embed", "mid_cnn", "ocr", "ocr_cls", "ocr_det", "ocr_rec", "resnet18", "simple",
                            "simple_identity", "simple_string", "tiny_cnn"]
    assert repo.get("tiny_cnn").onnx_path() == ROOT / "engines" / "tiny_cnn" / "1" / "model.onnx"
    assert repo.get("ocr").config.pipeline == "ocr"


@pytest.mark.parametrize("name", ["../tiny_cnn", "tiny_cnn/..", "/etc/passwd", "", "TINY_CNN", "tiny_cnn/1"])
def test_lookup_of_path_like_names_is_model_not_found(name):
    repo = ModelRepository(ROOT / "engines")
    with pytest.raises(ModelNotFound, match="unknown model"):
        repo.get(name)


def test_lookup_of_missing_or_non_numeric_version_is_model_not_found():
    repo = ModelRepository(ROOT / "engines")
    assert repo.get("tiny_cnn", "1").latest == 1
    for version in ("2", "x", "../1", "01a", "\u00b2", "9" * 5000):
        with pytest.raises(ModelNotFound, match="no version"):
            repo.get("tiny_cnn", version)


def test_served_subset_and_unknown_subset_name(tmp_path):
    repo = ModelRepository(ROOT / "engines", ["tiny_cnn"])
    assert repo.names() == ["tiny_cnn"]
    with pytest.raises(ConfigError, match=r"\['nope'\]"):
        ModelRepository(ROOT / "engines", ["nope"])
