"""Each error says whose fault it is, through the real ONNX Runtime backend: a client's mistake in
a request is a 400 that names it (the runtime's own text in the log only), a load's failure is a
400 only for a config its sender wrote, and a server fault a 500 (503 for capacity).
``tests/integration/test_whose_fault.py`` sends the same over HTTP to a running server."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from deployments.control import outcome
from deployments.protocol.errors import error_status
from deployments.runtime.contract.config import CacheOptions
from deployments.runtime.contract.errors import InferenceError, InvalidInput, InvalidModelFile, LoadFault, OverBudget
from deployments.runtime.contract.repository import ModelRepository
from deployments.runtime.residency.cache import ModelCache
from deployments.runtime.residency.host import ModelHost
from tests.token_models import WIDTH, token_config, token_inputs, write_token_model

ORT_LOGGER = "deployments.runtime.backends.onnxruntime"


def host_of(root: Path, name: str) -> ModelHost:
    return ModelHost(ModelRepository(root, [name]).get(name), "onnxruntime").load()


def test_token_ids_within_the_table_embed_as_the_table_says(tmp_path):
    host = host_of(write_token_model(tmp_path, "tokens").parent, "tokens")
    out = host.infer(token_inputs([[1, 2, 9], [0, -1, 3]]))["embeddings"]
    table = np.arange(10 * WIDTH, dtype=np.float32).reshape(10, WIDTH)
    np.testing.assert_array_equal(out, table[np.array([[1, 2, 9], [0, -1, 3]])])


def test_inputs_that_disagree_on_an_axis_the_model_names_are_400_naming_both(tmp_path):
    """Seen: ``input_ids`` of 3 tokens and an ``attention_mask`` of 4 answered 500 "ONNX
    Runtime run failed (Fail)"; both are ``[batch, sequence]`` in the graph."""
    host = host_of(write_token_model(tmp_path, "tokens").parent, "tokens")
    with pytest.raises(InvalidInput) as raised:
        host.infer(token_inputs([[1, 2, 3]], mask_length=4))
    assert raised.value.message == ("model 'tokens': inputs must agree on the dimension the model names 'sequence': "
                                    "'input_ids' axis 1 is 3, 'attention_mask' axis 1 is 4")
    assert error_status(raised.value) == (400, raised.value.message)


@pytest.mark.parametrize("token, element", [(10, 2), (-11, 0)])
def test_a_token_id_past_the_table_is_400_naming_the_element_and_the_range(tmp_path, token, element):
    """Seen: a token id past the embedding table answered 500 "ONNX Runtime run failed
    (InvalidArgument)"."""
    host = host_of(write_token_model(tmp_path, "tokens").parent, "tokens")
    ids = [[token, 1, 2]] if element == 0 else [[1, 2, token]]
    with pytest.raises(InvalidInput) as raised:
        host.infer(token_inputs(ids))
    assert raised.value.message == (
        f"model 'tokens' input 'input_ids': element {element} is {token}, past the 10 entries of the table it "
        "indexes (node 'embed'); allowed 0 to 9 (or -10 to -1, counted from the end)")
    assert error_status(raised.value)[0] == 400


def test_values_the_runtime_refuses_are_400_and_its_own_text_goes_to_the_log_only(tmp_path, caplog):
    """Ids shifted inside the graph (``Add``) before the ``Gather``: no check before the run sees
    the bound, so ONNX Runtime refuses the run (``InvalidArgument``): the client's."""
    host = host_of(write_token_model(tmp_path, "shifted", offset=5).parent, "shifted")
    with caplog.at_level(logging.INFO, logger=ORT_LOGGER):
        with pytest.raises(InvalidInput) as raised:
            host.infer(token_inputs([[1, 7]]))
    assert raised.value.message == (
        "model 'shifted': the model cannot compute these input values: ONNX Runtime refused them in its Gather "
        "node 'embed' (InvalidArgument), e.g. an index past a table it reads (a token id past the vocabulary); "
        "the server log has the runtime's message")
    assert error_status(raised.value)[0] == 400
    logged = [r for r in caplog.records if r.name == ORT_LOGGER]
    assert [r.levelname for r in logged] == ["INFO"]
    assert "indices element out of data bounds, idx=12 must be within the inclusive range [-10,9]" in logged[0].getMessage()


def test_a_run_failure_no_check_explains_is_500_and_the_runtime_text_is_logged_as_an_error(tmp_path, caplog):
    """The mask's axis has its own name in this graph, so nothing says before the run that the
    lengths must agree; the runtime's ``Fail`` is not known to be the client's: 500, logged."""
    host = host_of(write_token_model(tmp_path, "loose", mask_axis="mask_length").parent, "loose")
    with caplog.at_level(logging.INFO, logger=ORT_LOGGER):
        with pytest.raises(InferenceError) as raised:
            host.infer(token_inputs([[1, 2, 3]], mask_length=4))
    assert raised.value.message == ("model 'loose': ONNX Runtime run failed in its Mul node 'mask_mul' (Fail); "
                                    "the server log has the runtime's message")
    logged = [r for r in caplog.records if r.name == ORT_LOGGER]
    assert [r.levelname for r in logged] == ["ERROR"]
    assert "Attempting to broadcast an axis by a dimension other than 1. 3 by 4" in logged[0].getMessage()


# --- a load's failure: whose fault ------------------------------------------------------------

def _bad_config(root: Path) -> None:
    folder = write_token_model(root, "m")
    raw = token_config("m")
    raw["inputs"][0]["name"] = "ids"  # the model file calls it input_ids
    import yaml
    (folder / "config.yaml").write_text(yaml.safe_dump(raw))


def _unreadable(root: Path) -> None:
    folder = write_token_model(root, "m")
    data = (folder / "1" / "model.onnx").read_bytes()
    (folder / "1" / "model.onnx").write_bytes(data[: len(data) // 2])


def _no_session(root: Path) -> None:
    """A file that parses and checks (``onnx.checker``) but of which ONNX Runtime makes no session:
    a StringNormalizer whose locale this machine lacks (a newcomer's was told the file was
    "damaged, truncated or another format")."""
    import onnx
    from onnx import TensorProto, helper

    node = helper.make_node("StringNormalizer", ["text"], ["normalized"], case_change_action="LOWER",
                            locale="xx_YY.UTF-8")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("text", TensorProto.STRING, [None])],
                              [helper.make_tensor_value_info("normalized", TensorProto.STRING, [None])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    (root / "m" / "1").mkdir(parents=True)
    onnx.save(model, root / "m" / "1" / "model.onnx")


def _warmup_fails(root: Path) -> None:
    write_token_model(root, "m", vocab=5, warmup={"batch_sizes": [1], "data": "random"})  # ids 0-9


@pytest.mark.parametrize("make, status, fragment", [
    (_bad_config, 400, "config.yaml: inputs: ['ids', 'attention_mask'] are not the inputs of "),
    (_unreadable, 400, "model 'm': its model file m/1/model.onnx is not a valid ONNX model: onnx could not parse "
                       "it (DecodeError; damaged, truncated or another format)"),
    (_no_session, 400, "model 'm': ONNX Runtime could not create a session from its model file m/1/model.onnx: "
                       "Failed to construct locale with name:xx_YY.UTF-8"),
    (_warmup_fails, 400, "config.yaml: warmup: a warm-up run the model's config asks for failed: model 'm' input "
                         "'input_ids': element"),
], ids=["config-the-sender-wrote", "unreadable-model-file", "no-session", "warm-up-failure"])
def test_a_failed_load_reports_whose_fault_it_is(tmp_path, make, status, fragment):
    """A load through model control (the pool replica's ``apply``: the folder read, then
    ``ModelCache.load``, then ``outcome``) answers 400 for what its sender put in the repository:
    a config, a model file that does not parse, a warmup the config asks for that the model
    refuses (these two answered 500 before)."""
    make(tmp_path)
    caches = []
    with pytest.raises(Exception) as raised:
        caches.append(ModelCache(ModelRepository(tmp_path), ["m"], CacheOptions(load_policy="lru"),
                                 backend="onnxruntime"))
        caches[0].load("m")
    for cache in caches:
        cache.close()
    line = outcome(raised.value, False)
    assert line["loaded"] is False
    answered = error_status(line["error"])
    assert answered[0] == status and fragment in answered[1], answered


def test_a_load_over_the_memory_budget_is_503_capacity(tmp_path):
    write_token_model(tmp_path, "m")
    cache = ModelCache(ModelRepository(tmp_path), ["m"], CacheOptions(load_policy="lru", memory_budget_mib=0.001),
                       backend="onnxruntime")
    try:
        with pytest.raises(OverBudget) as raised:
            cache.load("m")
        assert error_status(outcome(raised.value, False)["error"])[0] == 503
    finally:
        cache.close()


def test_a_model_file_that_does_not_parse_is_invalid_and_a_missing_one_a_load_fault(tmp_path):
    _unreadable(tmp_path)
    with pytest.raises(InvalidModelFile):
        host_of(tmp_path, "m")
    entry = ModelRepository(tmp_path, ["m"]).get("m")
    entry.onnx_path().unlink()
    with pytest.raises(LoadFault, match="model 'm': ONNX Runtime could not read its model file m/1/model.onnx"):
        ModelHost(entry, "onnxruntime").load()


def test_a_pool_model_whose_file_went_after_an_eviction_answers_its_load_fault_naming_the_file(tmp_path):
    """A pool model loaded and measured, evicted, then its folder deleted: every request
    answered 500 "internal server error" (a FileNotFoundError from the measured footprint's
    lookup, before the load's own error handling) and readiness stayed ready. Its load now
    fails as any load of a missing file does (``LoadFault`` naming the file), and the cache
    reports that failure (``load_error``: readiness and the index give it)."""
    write_token_model(tmp_path, "m")
    cache = ModelCache(ModelRepository(tmp_path), ["m"], CacheOptions(load_policy="lru"), backend="onnxruntime")
    try:
        cache.load("m")
        assert cache.release("m") and cache.status()["models"]["m"]["state"] == "absent"  # evicted
        shutil.rmtree(tmp_path / "m")
        with pytest.raises(LoadFault, match=r"^model 'm': onnx could not read its model file m/1/model.onnx "
                                            r"\(FileNotFoundError\): the file is missing or unreadable"):
            cache.infer("m", token_inputs([[1, 2, 3]]))
        assert cache.status()["models"]["m"]["load_error"].startswith("model 'm': onnx could not read its model file")
    finally:
        cache.close()


def test_a_dimension_named_question_mark_ties_no_axes_together():
    """paddle2onnx writes "?" on every dynamic axis of the OCR models: it means "unknown", not
    one size (taken as a name, every ocr_cls request was refused: height 48 is not width 192)."""
    from deployments.runtime.contract.graph_checks import GraphChecks

    engines = Path(__file__).resolve().parents[2] / "engines"
    assert GraphChecks.read(engines / "ocr_cls" / "1" / "model.onnx").shared == ()
    simple = GraphChecks.read(engines / "simple" / "1" / "model.onnx")
    assert [(s.name, s.members) for s in simple.shared] == [("N", (("INPUT0", 0), ("INPUT1", 0)))]


def test_an_allocation_the_runtime_cannot_make_is_503_capacity_and_logged(caplog):
    """ONNX Runtime has no exception class for out of memory (a ``Fail`` or ``RuntimeException``
    saying so): an arena capped at 4 KiB (the CPU's, as ``gpu_mem_limit_mib`` caps the CUDA one)
    makes a real one."""
    import onnxruntime as ort

    from deployments.runtime.backends.onnxruntime import run_error
    from deployments.runtime.contract.errors import DeviceOutOfMemory
    from tests.token_models import token_model

    memory = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
    ort.create_and_register_allocator(memory, ort.OrtArenaCfg({"max_mem": 4096, "arena_extend_strategy": 1}))
    options = ort.SessionOptions()
    options.add_session_config_entry("session.use_env_allocators", "1")  # only this session uses it
    session = ort.InferenceSession(token_model().SerializeToString(), options, providers=["CPUExecutionProvider"])
    ids = np.ones((8, 64), np.int64)
    with pytest.raises(Exception) as raised:
        session.run(None, {"input_ids": ids, "attention_mask": ids})
    with caplog.at_level(logging.INFO, logger=ORT_LOGGER):
        error = run_error("tokens", raised.value)
    assert isinstance(error, DeviceOutOfMemory)
    assert error_status(error) == (503, "model 'tokens': out of memory while running in its Gather node 'embed'; "
                                        "retry later, or with fewer rows")
    logged = [r for r in caplog.records if r.name == ORT_LOGGER]
    assert [r.levelname for r in logged] == ["WARNING"] and "is smaller than requested bytes" in logged[0].getMessage()
