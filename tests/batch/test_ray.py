"""`--backend ray` (two actors, one engine each) gives the same records as the local backend."""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.batch.conftest import by_id, read_records, write_jsonl

pytestmark = [
    pytest.mark.ray,
    pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                       reason="ray is not installed (pip install 'celeris[ray]'); the Ray backend is not tested"),
]


def outcome(record: dict):
    """What must match across backends: status and answer texts, or the error code."""
    if record["response"] is None:
        return record["error"]["code"]
    body = record["response"]["body"]
    texts = [c.get("text", (c.get("message") or {}).get("content")) for c in body.get("choices", [])]
    return record["response"]["status_code"], texts, (body.get("error") or {}).get("code")


@pytest.mark.slow
def test_ray_backend_matches_local_at_temperature_zero(tmp_path, batch_checkpoint, subprocess_env):
    rows = [{"id": f"r{i}", "prompt": f"Once upon a time {i}", "max_tokens": 8, "temperature": 0} for i in range(8)]
    rows += [
        {"id": "sampled", "prompt": "Janet's ducks", "max_tokens": 8, "temperature": 0.8, "seed": 5},
        {"id": "chat", "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 8},
        {"id": "empty", "prompt": ""},
        '{"id": "broken"',
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    outputs = {}
    for backend in ("local", "ray"):
        out = tmp_path / f"{backend}.jsonl"
        cmd = [sys.executable, "-m", "celeris.cli", "batch", "run", str(src), str(out), "--model", str(batch_checkpoint),
               "--max-num-seqs", "2", "--backend", backend, "--num-workers", "2", "--no-progress"]
        done = subprocess.run(cmd, env=subprocess_env, capture_output=True, text=True, timeout=240)
        assert done.returncode == 3, done.stderr[-3000:]  # 3: some lines failed (the two planted ones)
        summary = json.loads(done.stdout.strip().splitlines()[-1])
        assert (summary["ran"], summary["succeeded"], summary["failed"]) == (12, 10, 2)
        outputs[backend] = {k: outcome(r) for k, r in by_id(read_records(out)).items()}
    assert outputs["ray"] == outputs["local"]
    assert not list(tmp_path.glob(".*spool*"))  # the spool file is removed


def wait_for(condition, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the job ended before {what}: {proc.communicate()[1][-3000:]!r}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def one_record(folder: Path):
    """The one session record in ``folder`` (None until it is written)."""
    from celeris.ray_session import SessionRecord

    paths = list(folder.glob("*.json"))
    return SessionRecord.read(paths[0]) if len(paths) == 1 else None


@pytest.mark.slow
def test_a_killed_job_leaves_no_ray_process_after_the_next_start(tmp_path, batch_checkpoint, subprocess_env):
    from celeris.ray_session import session_processes

    rows = [{"id": f"k{i}", "prompt": f"Once upon a time {i}", "max_tokens": 16, "steps": 16, "temperature": 0}
            for i in range(400)]
    src, out = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    sessions = tmp_path / "sessions"
    env = {**subprocess_env, "CELERIS_RAY_SESSIONS": str(sessions)}
    cmd = [sys.executable, "-m", "celeris.cli", "batch", "run", str(src), str(out), "--model", str(batch_checkpoint),
           "--max-num-seqs", "2", "--backend", "ray", "--num-workers", "1", "--no-progress"]

    def start() -> subprocess.Popen:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def lines() -> int:
        return out.read_bytes().count(b"\n") if out.exists() else 0

    first = start()
    wait_for(lambda: lines() >= 2, 240, "the first records", first)  # Ray, its agents and the actor run
    killed = one_record(sessions)
    names = {name for _, _, name in killed.processes}
    assert {"raylet", "gcs_server"} <= names, names  # the record names the instance's processes
    first.kill()
    first.wait(30)
    time.sleep(2)  # the GCS and raylet die with their parent; the raylet's agents stay (the fault)
    print("left by SIGKILL:", sorted(p.name() for p in session_processes(killed)))

    second = start()  # the next start reaps the orphans before it starts Ray again
    try:
        wait_for(lambda: not session_processes(killed), 60, "the orphaned session to be reaped", second)
        done = lines()
        wait_for(lambda: lines() > done + 1 and one_record(sessions) is not None, 240, "the second job's records",
                 second)
        running = one_record(sessions)
        assert running.session_dir != killed.session_dir and session_processes(running)
        second.send_signal(signal.SIGTERM)  # stops its own instance before it exits
        _, err = second.communicate(timeout=90)
    finally:
        if second.poll() is None:
            second.kill()
            second.wait(30)
    assert second.returncode == 143 and "Traceback" not in err, err[-3000:]
    assert "SIGTERM" in err
    assert session_processes(running) == [] and session_processes(killed) == []
    assert not list(sessions.glob("*.json"))  # the record of a stopped session is removed
