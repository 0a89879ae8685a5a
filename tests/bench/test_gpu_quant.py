"""The prepared quantization check for an accelerator runs end to end on CPU with small shapes (the same code a GPU
session runs): every method's kernel against the written-out matmul, the decoding modes quantized, the speed rows."""

from __future__ import annotations

import json

import pytest

from celeris.bench import gpu_quant


def test_gpu_quant_check_smoke_on_cpu(capsys):
    assert gpu_quant.main(["--device", "cpu", "--smoke", "--parts", "kernels,modes,speed"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert not [r for r in rows if "error" in r]
    kernels = [r for r in rows if r.get("check") == "kernel"]
    assert {r["method"] for r in kernels} == set(gpu_quant.METHODS) and all(r["ok"] for r in kernels)
    assert {r["kernel"] for r in kernels} == {"Int8Linear", "Int4Linear", "Fp8Linear"}
    modes = [r for r in rows if r.get("check") == "decoding-modes"]
    assert [r["width"] for r in modes] == ["float32", *gpu_quant.METHODS] and all(r["ok"] for r in modes)
    assert all(r["drafted"] > 0 for r in modes)
    speed = [r for r in rows if r.get("check") == "smollm2-shape-speed"]
    assert [(r["width"], r["batch"]) for r in speed] == [(w, b) for w in ("float32", "bfloat16", *gpu_quant.METHODS)
                                                         for b in (1, 8)]
    assert all(r["answer_tokens"] == 16 * r["batch"] and set(r["pass_cost_ms_by_width"]) == {"1", "2", "4", "8", "16"}
               for r in speed)
    assert all(0 < r["first_step_s"] < r["seconds"] for r in speed)  # the prefill step, timed inside the run


def test_a_failing_part_is_reported_and_fails_the_run(capsys, monkeypatch):
    def broken(device, smoke):
        raise RuntimeError("no kernel")

    monkeypatch.setattr(gpu_quant, "kernel_check", broken)
    assert gpu_quant.main(["--device", "cpu", "--smoke", "--parts", "kernels"]) == 1
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {"check": "kernels", "error": "RuntimeError: no kernel"} in rows


def test_gpu_quant_without_cuda_says_so(capsys):
    if gpu_quant.torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert gpu_quant.main([]) == 2
    assert "gpu_quant: error: no CUDA device" in capsys.readouterr().err
