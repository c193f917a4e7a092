"""``deployments.client.replica_counts``: the router's readiness counts read from Serve's instance
details as the controller sends them (states as Serve's str enums, or plain strings)."""

from __future__ import annotations

from ray.serve._private.common import ReplicaState
from ray.serve.schema import ApplicationStatus

from deployments.client import ReplicaCounts, replica_counts

DEPLOYMENTS = {"ocr_cls": ("models.ocr_cls", "model-ocr_cls"), "tiny_cnn": ("models.pool", "pool")}


def details(**apps) -> dict:
    return {"applications": apps}


def app(status, **deployments) -> dict:
    return {"status": status, "deployments": {name: {"replicas": [{"state": s} for s in states]}
                                              for name, states in deployments.items()}}


def test_running_replicas_are_counted_per_model_from_serve_enums():
    counts = replica_counts(details(**{
        "models": app(ApplicationStatus.RUNNING, router=[ReplicaState.RUNNING]),
        "models.pool": app(ApplicationStatus.RUNNING, pool=[ReplicaState.RUNNING, ReplicaState.STARTING]),
        "models.ocr_cls": app(ApplicationStatus.RUNNING, **{"model-ocr_cls": [ReplicaState.RUNNING] * 3})}),
        DEPLOYMENTS, own_app="models")
    assert counts == ReplicaCounts({"ocr_cls": 3, "tiny_cnn": 1})


def test_a_model_whose_application_is_not_listed_is_missing_with_no_replica():
    counts = replica_counts(details(**{"models": app("RUNNING", router=["RUNNING"]),
                                       "models.pool": app("RUNNING", pool=["RUNNING"])}), DEPLOYMENTS, own_app="models")
    assert counts == ReplicaCounts({"ocr_cls": 0, "tiny_cnn": 1}, missing=frozenset({"ocr_cls"}))


def test_a_deleting_application_stops_its_models_and_marks_the_server_deleting():
    counts = replica_counts(details(**{
        "models": app("RUNNING", router=["RUNNING"]), "models.pool": app("RUNNING", pool=["RUNNING"]),
        "models.ocr_cls": app(ApplicationStatus.DELETING, **{"model-ocr_cls": ["STOPPING"]})}), DEPLOYMENTS, "models")
    assert counts == ReplicaCounts({"ocr_cls": 0, "tiny_cnn": 1}, frozenset({"ocr_cls"}), True)


def test_the_callers_own_application_gone_means_the_server_stops():
    counts = replica_counts(details(**{"models.ocr_cls": app("RUNNING", **{"model-ocr_cls": ["RUNNING"]})}),
                            DEPLOYMENTS, own_app="models")
    assert counts.deleting and counts.stopped == frozenset({"tiny_cnn"})


def test_outside_a_replica_only_the_handles_count():
    counts = replica_counts(details(**{"models.ocr_cls": app("RUNNING", **{"model-ocr_cls": ["RUNNING"]})}),
                            {"ocr_cls": DEPLOYMENTS["ocr_cls"]})
    assert counts == ReplicaCounts({"ocr_cls": 1})
    assert replica_counts({}, {"ocr_cls": DEPLOYMENTS["ocr_cls"]}) == ReplicaCounts({"ocr_cls": 0},
                                                                                   missing=frozenset({"ocr_cls"}))


def test_the_running_replicas_are_named_by_id_for_model_control():
    """A load waits for the RUNNING replicas by id (``control.applied_everywhere``): a starting or
    stopping replica is not one of them."""
    pool = {"replicas": [{"state": "RUNNING", "replica_id": "a"}, {"state": "STARTING", "replica_id": "b"},
                         {"state": "STOPPING", "replica_id": "c"}]}
    counts = replica_counts(details(**{"models.pool": {"status": "RUNNING", "deployments": {"pool": pool}}}),
                            {"tiny_cnn": ("models.pool", "pool")})
    assert (counts.running, counts.running_ids) == ({"tiny_cnn": 1}, {"tiny_cnn": frozenset({"a"})})
