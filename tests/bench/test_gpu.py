"""The prepared accelerator check runs end to end on CPU with small shapes (the same code a GPU session runs)."""

from __future__ import annotations

import json

from celeris.bench import gpu


def test_gpu_check_smoke_on_cpu(capsys):
    assert gpu.main(["--device", "cpu", "--smoke"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    correctness = next(r for r in rows if r.get("check") == "correctness")
    assert correctness["ok"] and set(correctness["cache_modes"]) == {"none", "prefix", "dual", "delayed", "dual_delayed"}
    speed = [r for r in rows if r.get("check") == "llada-8b-shape"]
    assert [r["batch"] for r in speed] == [1, 8]
    assert all(r["tokens_per_s"] > 0 and r["full_pass_ms"] > 0 and r["answer_tokens"] > 0 for r in speed)
    block = next(r for r in rows if r.get("check") == "block-correctness")
    assert block["ok"] and set(block["decoding"]) == {"fixed", "low_confidence_dynamic", "threshold"}
    sdar = [r for r in rows if r.get("check") == "sdar-1.7b-shape"]
    assert [r["batch"] for r in sdar] == [1, 8]
    assert all(r["tokens_per_s"] > 0 and r["engine_step_ms"] > 0 and r["nfe"] >= 8 for r in sdar)


def test_gpu_check_without_cuda_says_so(capsys):
    if gpu.torch.cuda.is_available():
        return
    assert gpu.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err
