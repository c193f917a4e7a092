"""README.md shows the real files: the config.yaml example is the file it names, and the config
reference table lists every field of ModelConfig with its type and default."""

from __future__ import annotations

import re
from pathlib import Path

from deployments.check import reference
from deployments.runtime.contract.config import ModelConfig

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_every_yaml_block_headed_by_a_config_path_is_that_file():
    blocks = re.findall(r"```yaml\n# (engines/[a-z0-9_]+/config\.yaml)\n(.*?)```", README, re.S)
    assert blocks, "the README shows a model's config.yaml"
    for path, body in blocks:
        assert body == (ROOT / path).read_text(), f"README's {path} differs from the file"


def test_the_config_reference_table_lists_every_field_with_its_type_and_default():
    rows = re.findall(r"^\| `([^`]+)` \| `((?:[^`])+)` \| `([^`]+)` \|", README, re.M)
    table = [(path, kind.replace("\\|", "|"), default) for path, kind, default in rows
             if path.split(".")[0].split("[")[0] in ModelConfig.model_fields]
    assert table == [(p, k.replace("\\|", "|"), d) for p, k, d in reference(ModelConfig)]
