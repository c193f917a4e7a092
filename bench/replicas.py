"""The processes of one Ray Serve instance on this machine: find replicas, kill them, read RSS.

Ray names every actor's worker process after the actor (its process title, in
``/proc/<pid>/cmdline``): a Serve replica of deployment ``d`` in application ``a`` is
``ray::ServeReplica:a:d`` (with ``.method`` appended while it runs one). Ray's state API
(``ray list actors``) would give the same PIDs, but it needs the dashboard, which the servers
of the campaigns run without; the titles need nothing.

Every Ray process a driver starts (GCS, raylet, workers) stays in the driver's session
(``setsid``), so ``session`` (the session id of the process that called ``ray.init``) tells
one instance's processes from another helper's on the same machine.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPLICA_TITLE = "ray::ServeReplica:"


@dataclass(frozen=True)
class Proc:
    """One process: ``pid``, its title (``cmdline`` with NULs as spaces, first 200 chars)."""

    pid: int
    title: str


def _session_of(pid: int) -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rindex(")") + 2:].split()[3])  # fields after "(comm)": state ppid pgrp session
    return None


def session_processes(session: int) -> list[Proc]:
    """Every live process of session ``session`` (this machine's /proc), by pid."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or _session_of(int(entry.name)) != session:
            continue
        with contextlib.suppress(OSError):
            title = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            if title:
                found.append(Proc(int(entry.name), title[:200]))
    return sorted(found, key=lambda p: p.pid)


def replica_pids(session: int, app: str, deployment: str) -> list[int]:
    """PIDs of the running replicas of ``deployment`` (e.g. ``pool``, ``router``,
    ``model-ocr_cls``) of the server whose router application is ``app`` in the Ray instance in
    ``session`` (a dedicated model's deployment runs in its own application, ``app.<model>``)."""
    from deployments.client import deployment_application

    title = f"{REPLICA_TITLE}{deployment_application(app, deployment)}:{deployment}"
    return [p.pid for p in session_processes(session)
            if p.title == title or p.title.startswith((title + ".", title + " "))]


def kill_replica(session: int, app: str, deployment: str) -> int:
    """SIGKILL one replica of ``deployment`` (the first by pid); returns its pid.

    Raises:
        LookupError: no running replica of that deployment.
    """
    pids = replica_pids(session, app, deployment)
    for _ in range(10):  # a busy replica's title is rewritten per call (setproctitle): a read can miss it
        if pids:
            break
        time.sleep(0.2)
        pids = replica_pids(session, app, deployment)
    if not pids:
        raise LookupError(f"no running replica of {app}:{deployment} in session {session}")
    os.kill(pids[0], signal.SIGKILL)
    return pids[0]


def gone_at(pid: int, timeout_s: float = 30.0) -> float:
    """``time.monotonic()`` once process ``pid`` has exited (gone, or a zombie its parent has not
    reaped: its sockets are closed either way). ``os.kill`` returns before a SIGKILL takes
    effect, which on a busy machine is when the process is next scheduled: until then it still
    accepts connections (its listen backlog included).

    Raises:
        TimeoutError: still running after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return time.monotonic()
        if state in ("Z", "X"):
            return time.monotonic()
        time.sleep(0.005)
    raise TimeoutError(f"process {pid} still runs {timeout_s:g} s after its kill")


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` in bytes (``VmRSS`` of /proc/<pid>/status); 0 once gone."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024  # kB
    return 0


def cpu_seconds(pid: int) -> float:
    """CPU seconds ``pid`` has used (user + system, ``/proc/<pid>/stat``); 0 once gone."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2:].split()  # after "(comm)": state ppid ... utime(12) stime(13)
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return 0.0


def machine_busy_seconds() -> tuple[float, float]:
    """(busy, total) CPU seconds of this machine since boot, all cores (``/proc/stat``'s first
    line: busy = total - idle - iowait)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    tick = os.sysconf("SC_CLK_TCK")
    return (sum(fields) - fields[3] - fields[4]) / tick, sum(fields) / tick


class CpuSampler:
    """CPU use while a load runs: the machine's busy cores and the cores ``pids`` use, sampled
    from ``/proc`` every ``interval_s`` in a thread between ``__enter__`` and ``__exit__``.
    ``window(seconds)``: both over the last ``seconds`` sampled (for a load generator's measured
    window, which ends just before it returns)."""

    def __init__(self, pids: list[int], interval_s: float = 0.25) -> None:
        self.pids, self.interval_s = list(pids), interval_s
        self.samples: list[tuple[float, float, float]] = []  # (monotonic s, machine busy s, pids' s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_until_stopped, daemon=True)

    def _sample(self) -> None:
        self.samples.append((time.monotonic(), machine_busy_seconds()[0], sum(map(cpu_seconds, self.pids))))

    def _sample_until_stopped(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> "CpuSampler":
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def window(self, seconds: float) -> tuple[float, float]:
        """(machine busy cores, cores of ``pids``) averaged over the last ``seconds`` sampled."""
        end = self.samples[-1]
        start = next((s for s in self.samples if s[0] >= end[0] - seconds), self.samples[0])
        span = end[0] - start[0]
        if span <= 0:
            return 0.0, 0.0
        return round((end[1] - start[1]) / span, 2), round((end[2] - start[2]) / span, 2)


def server_rss_bytes(session: int, app: str) -> dict[str, int]:
    """RSS in bytes of the serving processes of ``session``, by role: each replica of router
    application ``app`` and of its models' applications (``app.<model>``) by its deployment
    (summed over replicas), Ray's own processes (``ray::`` actors: controller, proxy; raylet,
    GCS) as ``ray``. The driver and client processes are left out."""
    by_role: dict[str, int] = {}
    replica = re.compile(re.escape(f"{REPLICA_TITLE}{app}") + r"(?:\.[^:\s]+)?:(?P<deployment>[^.\s]+)")
    for p in session_processes(session):
        if (match := replica.match(p.title)) is not None:
            role = match["deployment"]
        elif p.title.startswith("ray::") or "/ray/core/src/ray/" in p.title or "gcs_server" in p.title:
            role = "ray"
        else:
            continue
        by_role[role] = by_role.get(role, 0) + rss_bytes(p.pid)
    return by_role


def interrupt_group(process: "subprocess.Popen", timeout_s: float = 60.0) -> None:
    """Ctrl-C a server started in its own session (SIGINT to its process group, as a terminal
    does); SIGKILL the group if it has not exited within ``timeout_s``. A group already gone (the
    server exited and its children with it) is left as it is."""
    try:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    except ProcessLookupError:
        process.wait()
