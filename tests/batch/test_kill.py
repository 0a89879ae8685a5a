"""`celeris batch run` as a subprocess: SIGKILL it twice mid-job, re-run, and lose or duplicate nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from celeris.batch.jobs import read_output
from tests.batch.conftest import by_id, read_records, write_jsonl

NUM_ITEMS = 200


def count_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def start_job(args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "celeris.cli", "batch", "run", *args, "--no-progress"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def kill_after(proc: subprocess.Popen, out: Path, at_least: int, timeout: float = 120.0) -> int:
    """SIGKILL ``proc`` as soon as ``out`` holds ``at_least`` lines; returns the lines it held."""
    deadline = time.monotonic() + timeout
    while count_lines(out) < at_least:
        assert proc.poll() is None, f"the job ended before it could be killed: {proc.communicate()[1][-2000:]!r}"
        assert time.monotonic() < deadline, "the job wrote too few records in time"
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    return count_lines(out)


@pytest.mark.slow
def test_sigkill_twice_then_rerun_loses_and_duplicates_nothing(tmp_path, batch_checkpoint, subprocess_env):
    rows = [{"id": f"s{i}", "prompt": f"Once upon a time {i}", "max_tokens": 16, "steps": 16, "temperature": 0}
            for i in range(NUM_ITEMS)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    args = [str(src), str(out), "--model", str(batch_checkpoint), "--max-num-seqs", "2"]

    first = kill_after(start_job(args, subprocess_env), out, at_least=5)
    assert 5 <= first < NUM_ITEMS
    state = read_output(out, repair=False)  # every complete line is a record; at most a torn tail
    assert len(state.status) in (first, first - 1)

    second = kill_after(start_job(args, subprocess_env), out, at_least=first + 10)
    assert second < NUM_ITEMS

    done = subprocess.run([sys.executable, "-m", "celeris.cli", "batch", "run", *args, "--no-progress"],
                          env=subprocess_env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["skipped_done"] >= second - 2 and summary["ran"] == NUM_ITEMS - summary["skipped_done"]
    records = by_id(read_records(out))  # raises on a duplicated id
    assert sorted(records) == sorted(r["id"] for r in rows)
    assert count_lines(out) == NUM_ITEMS
    assert all(r["response"]["status_code"] == 200 for r in records.values())
