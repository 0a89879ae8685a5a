"""Two-process DDP training on CPU (gloo) under torch.distributed.run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from celeris.models.loader import load_model
from tests.conftest import REPO_ROOT, TINY_TRAIN_MODEL

SCRIPT = """
import sys
from celeris.train.loop import TrainConfig, train

data, out, export = sys.argv[1:4]
cfg = TrainConfig(data_dir=data, out_dir=out, export_dir=export, model={model!r}, seq_len=32, batch_size=2,
                  max_steps=3, warmup_steps=2, eval_every=1000, eval_batches=1, save_every=1000, seed=0)
print("SUMMARY", train(cfg), flush=True)
"""


@pytest.mark.ddp
def test_ddp_two_processes_on_cpu(corpus_dir, tmp_path, subprocess_env):
    script = tmp_path / "ddp_train.py"
    script.write_text(SCRIPT.format(model=TINY_TRAIN_MODEL))
    out, export = tmp_path / "run", tmp_path / "export"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone", str(script),
         str(corpus_dir), str(out), str(export)],
        capture_output=True, text=True, timeout=150, cwd=REPO_ROOT, env=subprocess_env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "world 2" in proc.stdout
    assert proc.stdout.count("SUMMARY") == 2  # both ranks finished
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3
    assert summary["tokens_seen"] == 3 * 2 * 32 * 2  # two ranks' batches per step
    assert (out / "last.pt").is_file()
    assert len(json.loads((out / "history.json").read_text())) == 3
    model = load_model(export)
    assert sum(p.numel() for p in model.parameters()) == summary["parameters"]
