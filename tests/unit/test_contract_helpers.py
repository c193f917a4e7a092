"""The contract's small shared helpers: atomic writes, file hashes, MiB, pydantic error text."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from pydantic import ValidationError

from deployments.runtime.contract.config import CacheOptions, describe_validation_error
from deployments.runtime.contract.files import file_sha256, write_atomic
from deployments.runtime.contract.units import MIB, format_mib, mib_to_bytes


def test_write_atomic_replaces_the_file_whole_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "new" / "folder" / "file.json"
    write_atomic(target, "first\n")
    write_atomic(target, memoryview(b"second"))
    assert target.read_bytes() == b"second"
    assert [p.name for p in target.parent.iterdir()] == ["file.json"]


def test_file_sha256_is_the_digest_and_follows_a_rewrite(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(b"abc")
    assert file_sha256(path) == hashlib.sha256(b"abc").hexdigest()
    write_atomic(path, b"abcd")
    assert file_sha256(path) == hashlib.sha256(b"abcd").hexdigest()
    with pytest.raises(FileNotFoundError):
        file_sha256(tmp_path / "missing")


def test_sizes_are_mib_everywhere() -> None:
    assert mib_to_bytes(1.5) == 1_572_864 and MIB == 1 << 20
    assert format_mib(1_572_864) == "1.5 MiB" and format_mib(3 * 1024 * MIB) == "3,072.0 MiB"
    assert CacheOptions(memory_budget_mib=50).budget_bytes == 50 * MIB
    assert CacheOptions().budget_bytes is None and CacheOptions().load_policy == "lru"


def test_validation_errors_name_every_field_with_an_optional_prefix() -> None:
    with pytest.raises(ValidationError) as raised:
        CacheOptions.model_validate({"load_policy": "fifo", "memory_budget_mib": -1})
    text = describe_validation_error(raised.value, prefix="pool")
    assert text.startswith("pool.load_policy: Input should be 'eager', 'lazy' or 'lru'")
    assert "; pool.memory_budget_mib: Input should be greater than 0" in text
