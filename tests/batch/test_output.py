"""The output file: the lock is on the file (symlinks and hard links meet it), read-only and full
outputs are one-line errors with exit code 2 and never a torn line, rewrites keep a symlink."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from celeris.batch.jobs import BatchError, OutputLock, output_lock, run_batch
from celeris.cli import main
from tests.batch.conftest import FakeServing, by_id, completion_body, read_records, write_jsonl


def good_rows(n: int) -> list[dict]:
    return [{"id": f"q{i}", "prompt": f"Once upon a time {i}", "max_tokens": 8, "temperature": 0} for i in range(n)]


def second_name(path: Path, kind: str) -> Path:
    other = path.with_name(f"other-{kind}.jsonl")
    if kind == "symlink":
        other.symlink_to(path.name)  # relative, as users write them
    else:
        os.link(path, other)
    return other


# ---------------------------------------------------------------------------------------------
# The lock


@pytest.mark.parametrize("kind", ["symlink", "hard link"])
def test_lock_is_on_the_file_not_the_path(tmp_path, kind):
    """Two jobs writing one file through a link both ran (400 records for 200 ids)."""
    src = write_jsonl(tmp_path / "in.jsonl", good_rows(3))
    out = tmp_path / "out.jsonl"
    out.touch()
    other = second_name(out, kind)
    with output_lock(out), pytest.raises(BatchError, match="another batch job"):
        run_batch(src, other, FakeServing, progress=False)
    assert out.read_bytes() == b""


@pytest.mark.slow
def test_lock_held_by_another_process_through_a_hard_link(tmp_path, subprocess_env, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", good_rows(3))
    out = tmp_path / "out.jsonl"
    out.touch()
    other = second_name(out, "hard link")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom celeris.batch.output import output_lock\n"
         f"with output_lock({str(other)!r}):\n    print('locked', flush=True)\n    time.sleep(60)\n"],
        env=subprocess_env, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert main(["batch", "run", str(src), str(out), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "another batch job" in err
    finally:
        holder.kill()
        holder.wait()
    assert out.read_bytes() == b""


def test_lock_follows_the_rewritten_file(tmp_path):
    """--retry-failed puts a new file at the name; a second job must still find it locked."""
    src = write_jsonl(tmp_path / "in.jsonl", good_rows(3))
    out = tmp_path / "out.jsonl"
    run_batch(src, out, lambda: FakeServing(lambda body: (500, {"error": {"message": "boom", "code": "x"}})),
              progress=False)
    inode = out.stat().st_ino
    attempts: list[str] = []

    def answer(body: dict) -> tuple[int, dict]:
        try:
            OutputLock(out).acquire()
            attempts.append("acquired")
        except BatchError as exc:
            attempts.append(str(exc))
        return 200, completion_body("ok")

    summary = run_batch(src, out, lambda: FakeServing(answer), retry_failed=True, window=1, progress=False)
    assert summary["retried"] == 3 and out.stat().st_ino != inode
    assert len(attempts) == 3 and all("another batch job" in a for a in attempts), attempts


def test_rewrite_keeps_a_symlink_and_refuses_to_split_hard_links(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", good_rows(2))
    real = tmp_path / "real.jsonl"
    failing = lambda: FakeServing(lambda body: (500, {"error": {"message": "boom", "code": "x"}}))  # noqa: E731
    run_batch(src, real, failing, progress=False)
    link = second_name(real, "symlink")
    summary = run_batch(src, link, FakeServing, retry_failed=True, progress=False)
    assert summary["succeeded"] == 2 and link.is_symlink()
    assert all(r["response"]["status_code"] == 200 for r in read_records(real))

    run_batch(src, tmp_path / "h.jsonl", failing, progress=False)
    hard = second_name(tmp_path / "h.jsonl", "hard link")
    before = hard.read_bytes()
    with pytest.raises(BatchError, match="hard links"):
        run_batch(src, hard, FakeServing, retry_failed=True, progress=False)
    assert hard.read_bytes() == before


# ---------------------------------------------------------------------------------------------
# Read-only and full outputs


@contextmanager
def read_only(path: Path):
    """Make ``path`` (a file or a folder) unwritable for this process: chmod, or, for root (whom
    permissions do not stop), the immutable attribute; skips the test where neither works."""
    mode = path.stat().st_mode
    path.chmod(0o555 if path.is_dir() else 0o444)
    immutable = False
    try:
        if os.access(path, os.W_OK) or os.geteuid() == 0:
            chattr = shutil.which("chattr")
            if chattr is None or subprocess.run([chattr, "+i", str(path)], capture_output=True).returncode != 0:
                pytest.skip("cannot make a file read-only here (root, and no chattr +i)")
            immutable = True
        yield
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(path)], check=True)
        path.chmod(mode)


def test_read_only_output_folder_is_a_one_line_error(tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", good_rows(2))
    folder = tmp_path / "ro"
    folder.mkdir()
    with read_only(folder):
        code = main(["batch", "run", str(src), str(folder / "out.jsonl"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("celeris: error: cannot write the output file") and "Traceback" not in err


def test_read_only_output_file_is_a_one_line_error(tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", good_rows(2))
    out = tmp_path / "out.jsonl"
    run_batch(src, out, FakeServing, progress=False)
    write_jsonl(src, good_rows(3))  # one more to run
    before = out.read_bytes()
    with read_only(out):
        code = main(["batch", "run", str(src), str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("celeris: error: cannot write the output file") and out.read_bytes() == before


def limit_file_size(num_bytes: int):
    def apply() -> None:  # in the child: a file-size limit, and EFBIG instead of death by SIGXFSZ
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (num_bytes, resource.RLIM_INFINITY))

    return apply


@pytest.mark.slow
def test_full_disk_is_a_one_line_error_without_a_torn_line_and_resumes(tmp_path, subprocess_env):
    """A full output device (here a file-size limit) printed a traceback and left a torn last line."""
    rows = [{"id": f"m{i}", "max_tokens": 8, "note": "x" * 40} for i in range(30)]  # no prompt: recorded, no model
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "celeris.cli", "batch", "run", str(src), str(out), "--no-progress"]
    try:
        full = subprocess.run(cmd, env=subprocess_env, capture_output=True, text=True, timeout=120,
                              preexec_fn=limit_file_size(2000))
    except (ValueError, OSError) as exc:
        pytest.skip(f"cannot set a file-size limit here: {exc}")
    assert full.returncode == 2, full.stderr[-2000:]
    errors = [line for line in full.stderr.splitlines() if not line.startswith("celeris batch: ")]  # not notices
    assert len(errors) == 1 and errors[0].startswith("celeris: error: cannot write to"), full.stderr
    assert "File too large" in errors[0] and "rerun the same command" in errors[0]
    data = out.read_bytes()
    assert 0 < len(data) <= 2000 and data.endswith(b"\n")  # whole records only
    written = by_id(read_records(out))
    assert 0 < len(written) < 30

    done = subprocess.run(cmd, env=subprocess_env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr  # 3: lines failed (every line lacks a prompt), all recorded
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert (summary["skipped_done"], summary["ran"]) == (len(written), 30 - len(written))
    assert sorted(by_id(read_records(out))) == sorted(r["id"] for r in rows)
