"""`--backend ray` (two actors, one engine each) gives the same records as the local backend."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

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
