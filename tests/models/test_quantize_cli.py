"""`--quantization` on the command line: each model command takes it, bad values are one line and exit 2."""

from __future__ import annotations

import json

import pytest

from celeris.cli import build_parser, main


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("command", [["generate", "x"], ["chat"], ["serve"], ["eval", "humaneval"], ["bench"],
                                     ["batch", "run", "in.jsonl", "out.jsonl"]])
def test_every_model_command_takes_the_flags(command):
    args = build_parser().parse_args([*command, "--quantization", "int8", "--quantize-lm-head"])
    assert (args.quantization, args.quantize_lm_head) == ("int8", True)


@pytest.mark.parametrize(("flags", "needle"), [
    (["--quantization", "int3"], "--quantization: unknown quantization 'int3'; Celeris has int8, int4, int4-g64, "
                                 "int4-g128"),
    (["--quantize-lm-head"], "--quantize-lm-head needs --quantization"),
    (["--quantization", "int4-g128"], "layer 'layers.0.mlp.down_proj' has 704 input columns, not a multiple of the "
                                      "group of 128"),
])
def test_bad_quantization_exits_2_with_one_line(capsys, flags, needle):
    code, out, err = run_cli(capsys, "generate", "def f(x):", "--model", "celeris-code-6m", "--device", "cpu",
                             "--max-new-tokens", "4", "--steps", "4", *flags)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and needle in err, err


def test_generate_quantized(capsys):
    code, out, err = run_cli(capsys, "generate", "def add(a, b):\n", "--model", "celeris-code-6m", "--device", "cpu",
                             "--json", "--max-new-tokens", "8", "--steps", "8", "--quantization", "int4",
                             "--quantize-lm-head")
    assert code == 0, err
    assert len(json.loads(out)["token_ids"]) > 0


def test_bench_refuses_an_unknown_width_in_one_line(capsys, tmp_path):
    code, out, err = run_cli(capsys, "bench", "--model", "celeris-code-6m", "--quantization", "int8,fp3",
                             "--out", str(tmp_path))
    assert code == 2 and "unknown width(s) fp3;" in err and "the bench takes" in err and err.count("\n") == 1, err
    assert err.count("--quantization") == 1, err


def test_a_head_width_is_a_bench_name_only(capsys, tmp_path):
    """``int4+lm_head`` is checked as int4 by the bench (it gets past the method check to the bench's own), and is
    no method for the other commands."""
    code, out, err = run_cli(capsys, "bench", "--model", "celeris-code-6m", "--quantization", "int4+lm_head,fp3",
                             "--out", str(tmp_path))
    assert code == 2 and "unknown width(s) fp3;" in err and "the bench takes" in err and err.count("\n") == 1, err
    assert err.count("--quantization") == 1, err
    code, out, err = run_cli(capsys, "generate", "x", "--model", "celeris-code-6m", "--quantization", "int4+lm_head")
    assert code == 2 and "int4+lm_head" in err and err.count("\n") == 1, err


def test_bench_prints_each_width_and_its_warning(capsys, tiny_checkpoint, tmp_path):
    from tests.bench.test_run import write_prompts

    prompts = tmp_path / "he.jsonl"
    write_prompts(prompts, n=2)
    code, out, err = run_cli(capsys, "bench", "--model", str(tiny_checkpoint), "--ar-model", "none", "--lengths", "8",
                             "--num-prompts", "2", "--warmup", "0", "--prompts", str(prompts), "--no-smollm2",
                             "--quantization", "int8,bfloat16", "--out", str(tmp_path / "out"))
    assert code == 0, err
    results = json.loads((tmp_path / "out" / "bench.json").read_text())
    for width in ("int8", "bfloat16"):
        line = next(x for x in out.splitlines() if x.startswith(f"{width}: top-1 agreement "))
        assert "mean KL" in line and "pass cost ms by width" in line
        assert (f"warning: {width} misses its quality floor" in out) == (not results["widths"][width]["floor_met"])
    assert "dllm-fast@int8" in out and "dllm-fast@bfloat16" in out


def test_the_server_and_ray_serve_take_the_quantization():
    from celeris.serve.serving import OpenAIServing

    serving = OpenAIServing.from_model("celeris-code-6m-hybrid", device="cpu", quantization="int8")
    assert serving.llm.quantization["method"] == "int8"
    ray = pytest.importorskip("celeris.serve.ray")
    args = ray.ServeArgs(quantization="int4", quantize_lm_head=True)
    assert (args.quantization, args.quantize_lm_head) == ("int4", True)
