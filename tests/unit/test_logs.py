"""deployments.logs: the lines a developer needs reach the terminal once, and Serve's log file."""

from __future__ import annotations

import logging

import pytest

import deployments.protocol.errors  # noqa: F401  imports ray.serve, which sets up its logger at import, as in a replica
from deployments.logs import APP_LOGGER, SERVE_LOGGER, show_on_terminal


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def loggers():
    """``ray.serve`` set up as in a replica (one handler standing for its log file), restored after."""
    app, serve = logging.getLogger(APP_LOGGER), logging.getLogger(SERVE_LOGGER)
    saved = [(lg, lg.handlers[:], lg.filters[:], lg.level, lg.propagate) for lg in (app, serve)]
    app.handlers.clear()
    serve.handlers.clear()
    serve.setLevel(logging.INFO)
    serve.propagate = False
    log_file = Records()
    serve.addHandler(log_file)
    yield serve, log_file
    for lg, handlers, filters, level, propagate in saved:
        lg.handlers[:] = handlers
        lg.filters[:] = filters
        lg.setLevel(level)
        lg.propagate = propagate


def test_throughput_mode_shows_app_info_and_serve_warnings_on_stderr_once(loggers, capfd):
    serve, log_file = loggers
    show_on_terminal()
    show_on_terminal()  # idempotent
    logging.getLogger("deployments.runtime.residency.cache").info("model cache: evict tiny_cnn")
    serve.info("access line")
    serve.warning("serving error 503: no room")
    err = capfd.readouterr().err.splitlines()
    assert err == ["INFO deployments.runtime.residency.cache: model cache: evict tiny_cnn",
                   "WARNING ray.serve: serving error 503: no room"]
    assert log_file.messages == ["model cache: evict tiny_cnn", "access line", "serving error 503: no room"]


def test_where_serve_streams_itself_app_lines_go_through_serves_handlers_only(loggers, capfd):
    serve, log_file = loggers
    serve.addHandler(logging.StreamHandler())  # RAY_SERVE_LOG_TO_STDERR on (make serve FAST=0)
    show_on_terminal()
    logging.getLogger("deployments.ready").info("ready: 7 models")
    assert capfd.readouterr().err.splitlines() == ["ready: 7 models"]
    assert log_file.messages == ["ready: 7 models"]


def _request_failed(serve: logging.Logger, exc: BaseException) -> None:
    try:
        raise exc
    except Exception:
        serve.exception("Request failed.")  # what Serve's replica logs (replica.py)


def test_an_error_a_replica_raised_by_design_is_one_line_and_a_real_fault_keeps_its_traceback(loggers, capfd):
    from deployments.runtime.contract.errors import InvalidInput, ModelNotReady

    serve, log_file = loggers
    show_on_terminal()
    _request_failed(serve, InvalidInput("inference input 'x' data-type is 'FP64', model expects 'FP32'"))
    assert capfd.readouterr().err == ""
    assert log_file.messages == [
        "Request failed with client error 400: inference input 'x' data-type is 'FP64', model expects 'FP32'"]
    # a 503 (an answer by design) is one WARNING line; a real fault keeps Serve's ERROR line
    # with its traceback, on the terminal too
    _request_failed(serve, ModelNotReady("model 'm' is not ready"))
    _request_failed(serve, KeyError("boom"))
    err = capfd.readouterr().err
    assert err.count("ERROR ray.serve: Request failed.") == 1 and "KeyError: 'boom'" in err
    assert "ModelNotReady" not in err and "Traceback" in err
    assert log_file.messages[1:] == ["Request failed with error 503: model 'm' is not ready", "Request failed."]


def test_a_traceback_formatted_under_serves_replica_print_reads_as_text():
    """In a replica, Serve's ``redirected_print`` hands prints to other files the tuple of their
    objects, so ``logging`` formatted every traceback as ``('Traceback ...',)``;
    ``print_to_files_whole`` mends it, and prints to stdout still go to Serve's logger."""
    import builtins
    import io

    from ray.serve._private import logging_utils

    from deployments.logs import print_to_files_whole

    def formatted() -> str:
        try:
            raise ValueError("boom")
        except ValueError as e:
            return logging.Formatter().formatException((type(e), e, e.__traceback__))

    original = builtins.print
    builtins.print = logging_utils.redirected_print
    try:
        assert formatted().startswith("('Traceback (most recent call last):\\n',)")  # Serve 2.60's print
        print_to_files_whole()
        print_to_files_whole()  # idempotent
        text = formatted()
        assert text.startswith("Traceback (most recent call last):\n") and text.endswith("ValueError: boom")
        sink = io.StringIO()
        print("a", 1, sep="-", file=sink)
        assert sink.getvalue() == "a-1\n"
        serve, records = logging.getLogger(SERVE_LOGGER), []
        handler, level = logging.Handler(logging.INFO), serve.level
        handler.emit = records.append
        serve.addHandler(handler)
        serve.setLevel(logging.INFO)
        try:
            print("to", "stdout")
        finally:
            serve.removeHandler(handler)
            serve.setLevel(level)
        assert [r.getMessage() for r in records] == ["to stdout\n"]
    finally:
        builtins.print = original


def test_the_ready_line_counts_only_models_that_serve_now_and_names_the_rest():
    """It said "ready: 15 models" while models that had never run answered 500 to every request:
    a pool model not resident has not run yet (its first request loads it)."""
    from deployments.logs import ready_line

    line = ready_line("http://127.0.0.1:8000", ["ocr", "tiny_cnn", "mid_cnn", "late", "stuck"],
                      loaded={"ocr", "tiny_cnn", "mid_cnn", "stuck"}, ready={"ocr", "tiny_cnn", "mid_cnn"},
                      pool_models={"tiny_cnn", "mid_cnn"}, resident={"tiny_cnn"})
    assert line == ("ready: 2 models serving ['ocr', 'tiny_cnn']; "
                    "1 pool models load at their first request, not run yet: ['mid_cnn']; "
                    "not loaded (model control: POST /v2/repository/models/<name>/load): ['late']; "
                    "not serving (no replica has loaded them): ['stuck']; "
                    "KServe v2 at http://127.0.0.1:8000/v2 (POST http://127.0.0.1:8000/v2/models/{name}/infer)")
    assert ready_line("u", ["a"], {"a"}, {"a"}, set(), set()) == (
        "ready: 1 models serving ['a']; KServe v2 at u/v2 (POST u/v2/models/{name}/infer)")


def test_a_polled_outage_warns_once_with_its_traceback_and_says_when_it_answers_again(caplog):
    """Stopping a server printed the same traceback every turn of a replica's poll (the router's
    readiness watch, a pool replica's placement sync) while the deployment it asks had gone."""
    from deployments.logs import Outage

    outage = Outage(logging.getLogger("test.outage"), "placement: the decision is unavailable")
    with caplog.at_level(logging.INFO, logger="test.outage"):
        for turn in range(5):
            try:
                raise RuntimeError(f"turn {turn}")
            except RuntimeError:
                outage.failed()
        outage.answered()
        outage.answered()
        try:
            raise RuntimeError("again")
        except RuntimeError:
            outage.failed(quiet=True)  # expected (the application is being deleted): counted, not logged
        outage.answered()
    lines = [(r.levelname, r.getMessage(), r.exc_info[1].args[0] if r.exc_info else None) for r in caplog.records]
    assert lines == [
        ("WARNING", "placement: the decision is unavailable (logged once until it answers again)", "turn 0"),
        ("INFO", "placement: the decision is unavailable: answers again", None),
        ("INFO", "placement: the decision is unavailable: answers again", None)]
