"""The ``pool`` scenario's pure parts (``bench.throughput``, ``bench.replicas``): how clients are
split over the pool copies, the ``x router`` and ``of echo`` ratios, the copies' repository, and
the CPU seconds read from ``/proc/<pid>/stat``."""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from bench.loadgen import split_clients
from bench.replicas import cpu_seconds
from bench.throughput import pool_copies, pool_ratios, prepare_pool_repository

ENGINES = Path(__file__).resolve().parents[2] / "engines"


def row(path: str, r: int, c: int, qps: float) -> dict:
    return {"path": path, "router_replicas": r, "concurrency": c, "qps": qps}


def test_clients_split_evenly_over_the_copies_with_the_remainder_first():
    assert split_clients(64, 4) == [16, 16, 16, 16]
    assert split_clients(10, 4) == [3, 3, 2, 2]
    assert sum(split_clients(129, 4)) == 129


def test_x_router_is_the_pool_path_over_the_two_hop_path_at_the_same_point():
    rows = pool_ratios([row("pool", 2, 64, 2000.0), row("two_hop", 2, 64, 800.0), row("echo", 2, 64, 4000.0),
                        row("pool", 4, 64, 3000.0)])
    pool, two_hop, echo, alone = rows
    assert pool["x_router"] == 2.5 and pool["of_echo"] == 0.5
    assert two_hop["x_router"] == 1.0 and two_hop["of_echo"] == 0.2
    assert "x_router" not in echo
    assert alone["x_router"] is None and alone["of_echo"] is None  # no two-hop row at r=4: no ratio


def test_the_pool_repository_holds_the_dedicated_model_and_one_pool_copy_per_replica(tmp_path):
    repo = prepare_pool_repository(tmp_path / "engines", ENGINES, "tiny_cnn", 3, 3, gpu_fraction=0.1)
    assert sorted(p.name for p in repo.iterdir()) == ["tiny_cnn"] + pool_copies("tiny_cnn", 3)
    dedicated = yaml.safe_load((repo / "tiny_cnn" / "config.yaml").read_text())["deployment"]
    assert dedicated["mode"] == "dedicated" and dedicated["num_replicas"] == 3 and dedicated["num_gpus"] == 0.1
    copy = yaml.safe_load((repo / "tiny_cnn_pool2" / "config.yaml").read_text())
    assert copy["deployment"] == {"mode": "pool"} and copy["inputs"][0]["name"] == "input"
    assert (repo / "tiny_cnn_pool2" / "1").resolve() == (ENGINES / "tiny_cnn" / "1").resolve()


def test_cpu_seconds_of_this_process_grow_and_a_gone_process_reads_zero():
    assert cpu_seconds(os.getpid()) > 0
    assert cpu_seconds(2**22 + 12345) == 0.0
