"""Two-process DDP training on CPU (gloo) under torch.distributed.run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from celeris.models.loader import load_model
from tests.conftest import REPO_ROOT, TINY_TRAIN_MODEL

SCRIPT = """
import os
import sys

import torch

from celeris.train import loop
from celeris.train.loop import TrainConfig, train

data, out, export = sys.argv[1:4]
count_parameters = loop.count_parameters


def count_and_dump(model):  # train() calls this on every rank for its summary: dump that rank's weights
    torch.save(model.state_dict(), os.path.join(out, "rank" + os.environ["RANK"] + ".pt"))
    return count_parameters(model)


loop.count_parameters = count_and_dump
cfg = TrainConfig(data_dir=data, out_dir=out, export_dir=export, model={model!r}, seq_len=32, batch_size=2,
                  max_steps=3, warmup_steps=2, eval_every=1000, eval_batches=1, save_every=1000, seed=0)
print("SUMMARY", train(cfg), flush=True)
"""


@pytest.mark.slow
@pytest.mark.ddp
def test_ddp_two_processes_on_cpu(corpus_dir, tmp_path, subprocess_env):
    script = tmp_path / "ddp_train.py"
    script.write_text(SCRIPT.format(model=TINY_TRAIN_MODEL))
    out, export = tmp_path / "run", tmp_path / "export"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone", str(script),
         str(corpus_dir), str(out), str(export)],
        capture_output=True, text=True, timeout=300, cwd=REPO_ROOT, env=subprocess_env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "world 2" in proc.stdout
    assert proc.stdout.count("SUMMARY") == 2  # both ranks finished
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3
    assert summary["tokens_seen"] == 3 * 2 * 32 * 2  # two ranks' batches per step
    assert (out / "last.pt").is_file()
    assert len(json.loads((out / "history.json").read_text())) == 3
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    for name, value in ranks[0].items():  # gradients were averaged: both replicas hold the same weights
        assert torch.equal(value, ranks[1][name]), name
    model = load_model(export)
    for name, value in model.state_dict().items():
        assert torch.equal(value, ranks[0][name]), name
    assert sum(p.numel() for p in model.parameters()) == summary["parameters"]
