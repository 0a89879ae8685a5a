"""Records of local Ray sessions and the reaping of orphaned ones (``celeris.ray_session``), on stand-in
processes (``sleep``): no Ray instance is started here (tests/batch/test_ray.py kills a real one)."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import time

import pytest

if importlib.util.find_spec("ray") is None:  # not importorskip: the reaper needs no `import ray` (~0.7 s)
    pytest.skip("Ray is not installed", allow_module_level=True)

import psutil  # noqa: E402

from celeris.ray_session import SessionRecord, reap_orphaned_sessions, session_processes, sigterm_raises  # noqa: E402

NODE_ID = "ab" * 28


def sleeper(env: dict | None = None) -> subprocess.Popen:
    """A child that ignores SIGTERM, as the orphaned ``ray::DashboardAgent`` does: only SIGKILL ends it."""
    proc = subprocess.Popen(["sh", "-c", "trap '' TERM; echo; exec sleep 60"], env={**os.environ, **(env or {})},
                            stdout=subprocess.PIPE)
    proc.stdout.readline()  # SIGTERM is ignored from here on (exec keeps an ignored signal ignored)
    return proc


def identity(pid: int) -> list:
    return [pid, psutil.Process(pid).create_time()]


@pytest.fixture
def dead_owner() -> list:
    """The pid and start time of a process that has exited (an owner killed with SIGKILL)."""
    proc = subprocess.Popen(["true"])
    owner = identity(proc.pid)
    proc.wait()
    return owner


def test_an_orphaned_session_is_reaped_and_its_record_removed(tmp_path, dead_owner):
    dead_raylet = [dead_owner[0], dead_owner[1], "raylet"]  # exited with its owner
    named, agent = sleeper(), sleeper({"RAY_NODE_ID": NODE_ID})
    worker = sleeper({"RAY_RAYLET_PID": str(dead_raylet[0])})  # a worker started after the record
    stranger = sleeper({"RAY_NODE_ID": "cd" * 28, "RAY_RAYLET_PID": "1"})
    try:
        path = tmp_path / "session_x.json"
        SessionRecord("/tmp/ray/session_x", NODE_ID, dead_owner, [[*identity(named.pid), "gcs_server"], dead_raylet]
                      ).write(path)
        killed = reap_orphaned_sessions(tmp_path, grace_s=0.2)
        assert sorted(killed) == sorted([named.pid, agent.pid, worker.pid])  # named, or carrying its ids
        for proc in (named, agent, worker):  # gone, though they ignore SIGTERM (the reaper collected their status)
            proc.wait(10)
        assert stranger.poll() is None  # another session's process
        assert not path.exists()
    finally:
        for proc in (named, agent, worker, stranger):
            proc.kill()
            proc.wait()


def test_a_live_owners_session_and_a_reused_pid_are_left_alone(tmp_path, dead_owner):
    proc = sleeper({"RAY_NODE_ID": NODE_ID})
    try:
        live = tmp_path / "live.json"
        SessionRecord("/tmp/ray/session_live", NODE_ID, identity(os.getpid()), [[*identity(proc.pid), "raylet"]]).write(live)
        assert reap_orphaned_sessions(tmp_path) == [] and live.exists() and proc.poll() is None
        live.unlink()
        # the recorded pid now belongs to a process that started later: not the session's, and neither are
        # the processes that name it as their raylet
        reused = [proc.pid, psutil.Process(proc.pid).create_time() - 100.0, "raylet"]
        child = sleeper({"RAY_RAYLET_PID": str(proc.pid)})
        record = SessionRecord("/tmp/ray/session_old", "ef" * 28, dead_owner, [reused])
        assert session_processes(record) == []
        record.write(tmp_path / "old.json")
        assert reap_orphaned_sessions(tmp_path) == [] and proc.poll() is None and child.poll() is None
        assert not (tmp_path / "old.json").exists()
    finally:
        for p in (proc, *([child] if "child" in locals() else [])):
            p.kill()
            p.wait()


def test_unreadable_records_are_skipped(tmp_path):
    (tmp_path / "torn.json").write_text('{"session_dir": "/tmp/ray/s')
    assert reap_orphaned_sessions(tmp_path) == [] and (tmp_path / "torn.json").exists()


def test_sigterm_raises_unwinds_the_block_and_restores_the_handler():
    before = signal.getsignal(signal.SIGTERM)
    seen, cleaned = [], []
    with pytest.raises(SystemExit) as info:
        with sigterm_raises(lambda: seen.append("signal")):
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the handler runs before this ends
            finally:
                cleaned.append(True)
    assert info.value.code == 143 and seen == ["signal"] and cleaned == [True]
    assert signal.getsignal(signal.SIGTERM) is before
