"""What a developer sees on the ``serve run`` terminal, in every Serve mode.

Ray Serve writes each replica's log to its own file under
``/tmp/ray/session_latest/logs/serve/`` (``replica_<app>_<deployment>_<id>.log``). With
``RAY_SERVE_THROUGHPUT_OPTIMIZED=1`` (``make serve``'s default) it no longer copies them to
stderr, so the terminal goes silent after "Submitted deploy config successfully".
``show_on_terminal()``, called first in every deployment's constructor, puts back the lines
that matter, on the replica process's own stderr (which Ray streams to the driver's terminal,
prefixed with the replica's name and pid):

* the ``deployments`` loggers at INFO and above: the router's ready line (``ready_logger``),
  model loads and unloads, the pool cache's loads, evictions and refusals. These records also
  go to the replica's Serve log file.
* ``ray.serve`` at WARNING and above: failed requests (5xx, with the error; internal errors
  with their traceback), replicas lost mid-request. A client error (4xx) a replica raised, which
  Serve logs as "Request failed." with a traceback, becomes one INFO line without it (file only).

Where Serve already copies its log to stderr (``RAY_SERVE_LOG_TO_STDERR`` on, e.g.
``make serve FAST=0``), the ``deployments`` records go through Serve's handlers only, so no
line shows twice. Per-request access lines stay in the files.
"""

from __future__ import annotations

import builtins
import logging
import sys
from typing import Any, Container, Iterable

SERVE_LOGGER = "ray.serve"
APP_LOGGER = "deployments"
ready_logger = logging.getLogger(f"{APP_LOGGER}.ready")  # the router's "ready: ... at URL" line

_FORMAT = "%(levelname)s %(name)s: %(message)s"


def ready_line(url: str, names: Iterable[str], loaded: Container[str], ready: Container[str],
               pool_models: Container[str], resident: Container[str]) -> str:
    """The router's ready line: only the models that serve now count as ready (a dedicated
    model or pipeline a replica has loaded, ``ready``; a pool model resident in the pool
    replica's cache, ``resident``); a pool model not resident loads at its first request, so
    that request is its first test: it is named as such, not counted; a model not
    ``loaded`` (explicit model control) is named apart; any other model, not ready (a replica
    that has not loaded it), is named as not serving."""
    names = sorted(names)
    serving = [n for n in names if n in loaded and (n in resident if n in pool_models else n in ready)]
    first = [n for n in names if n in loaded and n in pool_models and n not in resident]
    off = [n for n in names if n not in loaded]
    waiting = [n for n in names if n in loaded and n not in pool_models and n not in ready]
    parts = [f"ready: {len(serving)} models serving {serving}"]
    if first:
        parts.append(f"{len(first)} pool models load at their first request, not run yet: {first}")
    if off:
        parts.append(f"not loaded (model control: POST /v2/repository/models/<name>/load): {off}")
    if waiting:
        parts.append(f"not serving (no replica has loaded them): {waiting}")
    return "; ".join(parts) + f"; KServe v2 at {url}/v2 (POST {url}/v2/models/{{name}}/infer)"


class _AnsweredErrorsOnOneLine(logging.Filter):
    """Serve's replica logs every exception a request raised at ERROR, "Request failed." with
    its traceback (``ray/serve/_private/replica.py``, ``_handle_errors_and_metrics``). An error
    the error table answers by design is one line naming it: a 4xx (the client's) at INFO, a
    503 or 504 (not ready, over budget, shed, timed out) at WARNING. A 500 keeps its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None or record.msg != "Request failed.":
            return True
        from .protocol.errors import table_status  # imports Ray: only where a replica logs

        status = table_status(exc)
        if status is not None and status != 500:
            level, what = (logging.INFO, "client error") if status < 500 else (logging.WARNING, "error")
            record.msg, record.args = f"Request failed with {what} %d: %s", (status, exc)
            record.levelno, record.levelname = level, logging.getLevelName(level)
            record.exc_info = record.exc_text = None
        return True


class _TerminalHandler(logging.StreamHandler):
    """A handler on the process's original stderr (Ray streams it to the driver)."""


class _ToServeLog(logging.Handler):
    """Hands a record to the ``ray.serve`` logger's own handlers (the replica's log file, and
    stderr where Serve streams), skipping ours so a line never prints twice."""

    def emit(self, record: logging.LogRecord) -> None:
        for handler in logging.getLogger(SERVE_LOGGER).handlers:
            if not isinstance(handler, _TerminalHandler) and record.levelno >= handler.level:
                handler.handle(record)


def _serve_streams(serve: logging.Logger) -> bool:
    """Whether Serve copies its log to stderr itself (a plain StreamHandler of its own)."""
    return any(type(h) is logging.StreamHandler for h in serve.handlers)


def print_to_files_whole() -> None:
    """Mend Ray Serve 2.60's ``print`` in a replica: where Serve does not stream its log to stderr
    (``make serve``'s default), it replaces ``builtins.print`` with ``logging_utils.redirected_print``,
    which hands a print to any other file the tuple of its objects (``buildin_print(objects,
    ...)``, not ``*objects``). ``traceback.print_exception`` prints each line to a StringIO, so
    every traceback ``logging`` formatted read ``('Traceback (most recent call last):\n',)('  File
    ...',)``, the error of an internal fault included. Ours prints to other files as the builtin
    does and leaves stdout and stderr to Serve's. Idempotent; nothing where print is not Serve's."""
    current = builtins.print
    if getattr(current, "__name__", "") != "redirected_print" or "ray.serve" not in getattr(current, "__module__", ""):
        return
    builtin = sys.modules[current.__module__].buildin_print

    def print_whole(*objects: Any, sep: str | None = " ", end: str | None = "\n", file: Any = None,
                    flush: bool = False) -> None:
        if file not in (sys.stdout, sys.stderr, None):
            return builtin(*objects, sep=sep, end=end, file=file, flush=flush)
        return current(*objects, sep=sep, end=end, file=file, flush=flush)

    builtins.print = print_whole


def show_on_terminal() -> None:
    """Route the application's log lines as the module docstring says (and ``print_to_files_whole``).
    Idempotent per process."""
    print_to_files_whole()
    app = logging.getLogger(APP_LOGGER)
    if any(isinstance(h, _ToServeLog) for h in app.handlers):
        return
    serve = logging.getLogger(SERVE_LOGGER)
    app.setLevel(logging.INFO)
    app.propagate = False
    app.addHandler(_ToServeLog())
    serve.addFilter(_AnsweredErrorsOnOneLine())
    if _serve_streams(serve):
        return
    for logger, level in ((app, logging.INFO), (serve, logging.WARNING)):
        terminal = _TerminalHandler(sys.__stderr__)
        terminal.setLevel(level)
        terminal.setFormatter(logging.Formatter(_FORMAT))
        logger.addHandler(terminal)


class Outage:
    """The failures of something a replica polls (Serve's controller, the control or placement
    deployment, the GCS), logged once per outage rather than once per turn: ``failed`` (called
    in the ``except`` block, so the first failure's traceback is kept) warns at the first failure
    after an answer, ``answered`` says so once it answers again. ``quiet=True``: a failure that
    is expected (the application is being deleted, its deployments stop before this replica)
    counts without a warning."""

    def __init__(self, logger: logging.Logger, what: str) -> None:
        self.logger, self.what, self.down = logger, what, False

    def failed(self, quiet: bool = False) -> None:
        if not (self.down or quiet):
            self.logger.warning("%s (logged once until it answers again)", self.what, exc_info=True)
        self.down = True

    def answered(self) -> None:
        if self.down:
            self.logger.info("%s: answers again", self.what)
        self.down = False
