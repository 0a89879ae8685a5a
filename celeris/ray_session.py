"""Local Ray instances this package starts: recorded, stopped with their process, reaped when orphaned.

``ray.init()`` without an address starts a Ray instance of its own (GCS, raylet, monitor, log monitor,
and the raylet's ``ray::DashboardAgent`` / ``ray::RuntimeEnvAgent`` and workers). The GCS and raylet
die with the driver (Linux ``PR_SET_PDEATHSIG``), but the raylet's agents do not: after a SIGKILL of
the driver (or a SIGTERM it did not handle) they stay alive, re-parented to init, ~200 MB together,
until killed by hand. A process killed with SIGKILL cannot clean up after itself, so:

* ``LocalRaySession.start`` first reaps every orphaned session of this user (its owner is gone), then
  starts Ray and writes a record (``sessions_dir() / <session>.json``): the session folder, the node
  id, the owner's pid and start time, and the pid and start time of every process of the instance;
* ``LocalRaySession.stop`` (called by the owner on SIGTERM, at exit or when done) shuts Ray down, kills
  whatever of the instance is still alive, and removes the record;
* ``reap_orphaned_sessions`` kills what a record names, plus any process of this user whose environment
  carries the session's ``RAY_NODE_ID`` (Ray sets it in the raylet's agents) or its raylet's pid as
  ``RAY_RAYLET_PID`` (in every worker), including those started after the record was written, and
  removes the record.

A process is only ever killed when its pid *and* its start time match the record (a reused pid is
left alone), or when it carries the dead session's node id or raylet pid (not when that pid now belongs
to another process). ``CELERIS_RAY_SESSIONS`` moves the records
(default: ``celeris-ray-<uid>`` in the temp folder, which a reboot empties along with the pids).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

try:
    import psutil
except ImportError:  # Ray ships it (ray/thirdparty_files, on the path once ray is imported) when it is not installed
    import ray  # noqa: F401

    import psutil  # isort: skip - after ray, which puts its copy on the path

# Ray itself is imported where a session starts or stops, not here: the reaper and its records need only psutil, and
# `import ray` costs ~0.7 s

logger = logging.getLogger(__name__)

TERM_GRACE_S = 2.0  # after SIGTERM, seconds before SIGKILL
SHUTDOWN_GRACE_S = 5.0  # after ray.shutdown(), seconds the instance's processes have to exit by themselves


class RayStartError(RuntimeError):
    """A local Ray instance could not start; the message is one line."""


def sessions_dir() -> Path:
    """The folder of the records (``$CELERIS_RAY_SESSIONS``, else ``<tmp>/celeris-ray-<uid>``)."""
    folder = os.environ.get("CELERIS_RAY_SESSIONS")
    return Path(folder) if folder else Path(tempfile.gettempdir()) / f"celeris-ray-{os.getuid()}"


@dataclass(slots=True)
class SessionRecord:
    """What a local Ray instance was, as written to its record file.

    Attributes:
        session_dir: Ray's session folder (``/tmp/ray/session_...``).
        node_id: the head node's id (hex), also ``RAY_NODE_ID`` in its agents' and workers' environment.
        owner: ``[pid, start time]`` of the process that started the instance (start times: seconds since
            the epoch, as ``psutil.Process.create_time`` gives them).
        processes: ``[pid, start time, name]`` of every process of the instance when it was recorded.
    """

    session_dir: str
    node_id: str
    owner: list
    processes: list = field(default_factory=list)

    @classmethod
    def read(cls, path: Path) -> SessionRecord | None:
        """The record at ``path``, or None when it is unreadable (a torn or foreign file)."""
        try:
            data = json.loads(path.read_text())
            return cls(str(data["session_dir"]), str(data["node_id"]), list(data["owner"]), list(data["processes"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(asdict(self)))
        os.replace(tmp, path)


def _identity(proc: psutil.Process) -> list:
    return [proc.pid, proc.create_time()]


def _alive(pid: int, start_time: float) -> psutil.Process | None:
    """The process ``pid`` if it is still the one that started at ``start_time`` and is not a zombie."""
    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - start_time) > 0.05 or proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc
    except psutil.Error:
        return None


def _raylet_pid(record: SessionRecord) -> str | None:
    """The recorded raylet's pid (as ``RAY_RAYLET_PID`` spells it), unless that pid is now another process's."""
    for pid, start, *name in record.processes:
        if name and name[0] == "raylet":
            try:
                reused = abs(psutil.Process(pid).create_time() - start) > 0.05
            except psutil.Error:  # gone: only the session's own processes can still name it
                reused = False
            return None if reused else str(pid)
    return None


def session_processes(record: SessionRecord) -> list[psutil.Process]:
    """The live processes of ``record``'s instance: those it names, and this user's whose environment carries
    its node id (``RAY_NODE_ID``: the raylet's agents) or its raylet's pid (``RAY_RAYLET_PID``: workers)."""
    found = {p.pid: p for p in (_alive(pid, start) for pid, start, *_ in record.processes) if p is not None}
    raylet_pid = _raylet_pid(record)
    uid = os.getuid()
    for proc in psutil.process_iter(["uids"]):
        if proc.pid in found or proc.pid == os.getpid() or proc.info["uids"] is None or proc.info["uids"].real != uid:
            continue
        try:
            env = proc.environ()
            if (env.get("RAY_NODE_ID") == record.node_id or (raylet_pid and env.get("RAY_RAYLET_PID") == raylet_pid)) \
                    and proc.status() != psutil.STATUS_ZOMBIE:
                found[proc.pid] = proc
        except psutil.Error:
            continue
    return list(found.values())


def kill_processes(procs: list[psutil.Process], grace_s: float = TERM_GRACE_S) -> list[int]:
    """SIGTERM ``procs``, SIGKILL those still alive after ``grace_s``; returns the pids signalled."""
    signalled = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
            signalled.append(proc.pid)
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=grace_s)
    return signalled


def reap_orphaned_sessions(folder: Path | None = None, grace_s: float = TERM_GRACE_S) -> list[int]:
    """Kill the processes of every recorded session whose owner is gone and remove its record.

    Records in ``folder`` (default ``sessions_dir()``) of a live owner are left alone (another job's
    instance). ``grace_s``: seconds between SIGTERM and SIGKILL. Returns the pids signalled.
    """
    folder = folder or sessions_dir()
    killed: list[int] = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        record = SessionRecord.read(path)
        if record is None:
            continue
        if _alive(*record.owner[:2]) is not None:
            continue
        procs = session_processes(record)
        if procs:
            logger.warning("reaping %d process(es) of the orphaned Ray session %s", len(procs), record.session_dir)
            killed += kill_processes(procs, grace_s)
        path.unlink(missing_ok=True)
    return killed


class LocalRaySession:
    """A local Ray instance started by this process (see the module docstring).

    Attributes:
        record: what was recorded; ``path``: its record file.
    """

    def __init__(self, record: SessionRecord, path: Path) -> None:
        self.record = record
        self.path = path
        self._stopped = False
        self._lock = threading.Lock()
        atexit.register(self.stop)

    @classmethod
    def start(cls, **init_kwargs: object) -> LocalRaySession:
        """Reap orphaned sessions, then ``ray.init(address="local", **init_kwargs)`` and record the instance.

        ``address="local"`` starts a new instance even where ``ray start`` left its address file behind.
        The caller's SIGTERM handler is kept (``ray.init`` replaces it with ``sys.exit``).

        Raises:
            RayStartError: ``ray.init`` failed (what it had started is shut down).
        """
        import ray

        reap_orphaned_sessions()
        in_main = threading.current_thread() is threading.main_thread()
        previous = signal.getsignal(signal.SIGTERM) if in_main else None
        try:
            ray.init(address="local", **init_kwargs)
        except Exception as exc:  # a raylet or GCS that did not come up (an overloaded machine, no /dev/shm ...)
            with contextlib.suppress(Exception):
                ray.shutdown()
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise RayStartError(f"a local Ray instance could not start: {first}") from exc
        finally:
            if in_main and previous is not None:
                signal.signal(signal.SIGTERM, previous)
        node = ray._private.worker._global_node  # the public API does not expose the session folder
        me = psutil.Process()
        record = SessionRecord(session_dir=node.get_session_dir_path(), node_id=ray.get_runtime_context().get_node_id(),
                               owner=_identity(me))
        session = cls(record, sessions_dir() / f"{Path(record.session_dir).name}.json")
        session.refresh()
        return session

    def refresh(self) -> None:
        """Record the instance's processes as they are now (this process's descendants)."""
        procs = []
        for proc in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                procs.append([*_identity(proc), proc.name()])
        self.record.processes = procs
        self.record.write(self.path)

    def stop(self) -> None:
        """Shut Ray down, kill what is left of the instance, remove the record (idempotent, any thread)."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        import ray

        with contextlib.suppress(Exception):
            ray.shutdown()
        procs = session_processes(self.record)
        _, alive = psutil.wait_procs(procs, timeout=SHUTDOWN_GRACE_S) if procs else ([], [])
        if alive:
            logger.warning("%d process(es) of the Ray session outlived ray.shutdown(); killing them", len(alive))
            kill_processes(alive)
        self.path.unlink(missing_ok=True)
        atexit.unregister(self.stop)


class Terminated(SystemExit):
    """Raised in the main thread by ``sigterm_raises`` when SIGTERM arrives: unwinds ``finally`` blocks, then
    (uncaught) ends the process quietly with status 143 (128 + SIGTERM), as the signal would have."""

    def __init__(self) -> None:
        super().__init__(128 + signal.SIGTERM)


@contextlib.contextmanager
def sigterm_raises(on_signal: Callable[[], None] | None = None) -> Iterator[None]:
    """Within the block, SIGTERM raises ``Terminated`` in the main thread (so cleanup runs); the previous
    handler comes back after it. Outside the main thread it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(sig: int, frame) -> None:  # noqa: ANN001
        if on_signal is not None:
            on_signal()
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
