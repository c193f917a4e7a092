"""``states.ModelStates``: one status per model, and the transitions the routes make."""

from __future__ import annotations

from deployments.states import ModelState, ModelStates, Status


def test_models_loaded_at_start_are_loading_until_a_replica_answers_and_pool_models_are_ready():
    states = ModelStates(["det", "cnn"], ready=["cnn", "other"])
    assert (states.status("det"), states.status("cnn")) == (Status.LOADING, Status.READY)
    assert states.is_loaded("det") and not states.is_ready("det")
    assert states.status("other") is Status.NOT_LOADED  # ready at start only where loaded
    states.answered("det")
    assert states.is_ready("det") and states.names(Status.READY) == {"det", "cnn"}


def test_a_model_never_recorded_is_not_loaded_and_its_reason_names_the_load_route():
    assert ModelStates([]).get("new") == ModelState(
        Status.NOT_LOADED, "not loaded: POST /v2/repository/models/new/load loads it")


def test_an_answer_does_not_make_a_model_that_is_not_loaded_ready():
    states = ModelStates(["a"])
    states.unloaded("a")
    states.answered("a")
    states.answered("b")
    assert (states.status("a"), states.status("b")) == (Status.UNLOADED, Status.NOT_LOADED)


def test_a_ready_model_that_lost_its_replicas_is_loading_again_and_ready_once_one_answers():
    states = ModelStates(["a"], ready=["a"])
    assert states.lost("a") is True
    assert states.get("a") == ModelState(Status.LOADING, "no running replica")
    assert states.lost("a") is False  # only a READY model is lost
    states.answered("a")
    assert states.is_ready("a")


def test_an_unloaded_model_is_unavailable_unloaded_and_a_load_makes_it_ready():
    states = ModelStates(["a"], ready=["a"])
    states.unloaded("a")
    assert not states.is_loaded("a") and states.get("a") == ModelState(Status.UNLOADED, None)
    assert states.get("a").index_reason == "unloaded"
    states.loaded("a")
    assert states.get("a") == ModelState(Status.READY, None)


def test_a_failed_load_keeps_its_reason():
    states = ModelStates([])
    states.unloaded("a", "failed to load 'a': bad config")
    assert states.get("a") == ModelState(Status.UNLOADED, "failed to load 'a': bad config")
    assert states.get("a").index_reason == "failed to load 'a': bad config"


def test_the_index_names_triton_states():
    assert {s: s.index_state for s in Status} == {
        Status.NOT_LOADED: "UNAVAILABLE", Status.LOADING: "LOADING", Status.READY: "READY",
        Status.UNLOADED: "UNAVAILABLE"}
