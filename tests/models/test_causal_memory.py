"""``max_model_len``: the KV store follows it and the K/V heads, the memory estimate counts the store before any
weight is read, and a value past the model's context is refused with one line (CLI exit 2, server start too)."""

from __future__ import annotations

import pytest
import torch

from celeris.cli import main
from celeris.config import CPU_MAX_MODEL_LEN, resolve_max_model_len
from celeris.llm import LLM
from celeris.models import loader
from celeris.models.loader import CheckpointError, kv_cache_bytes, load_any
from celeris.sampling.modes import ContextLengthError
from celeris.sampling.verified import MAX_DRAFTS
from tests.models.conftest_causal import TINY, tiny_causal

LAYERS, KV_HEADS, HEADS, HEAD_DIM = TINY["num_hidden_layers"], TINY["num_key_value_heads"], TINY[
    "num_attention_heads"], TINY["hidden_size"] // TINY["num_attention_heads"]
CONTEXT = TINY["max_position_embeddings"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("mem") / "tiny-llama"
    tiny_causal("llama", path, tie_word_embeddings=True)
    return path


def store_bytes(rows: int, tokens: int, heads: int = KV_HEADS) -> int:
    return 2 * LAYERS * rows * heads * tokens * HEAD_DIM * 4  # keys and values, float32


@pytest.mark.parametrize(("rows", "max_model_len"), [(3, 40), (2, 20)])
def test_verified_pool_follows_max_model_len_and_the_kv_heads(folder, rows, max_model_len):
    llm = LLM(folder, max_num_seqs=rows, max_model_len=max_model_len)
    params = llm.default_params(max_tokens=4, decoding="verified", draft_source="lookup")
    llm.generate([[5, 6, 7]], params)
    pad = 2 * MAX_DRAFTS + 2  # the columns the last pass's drafts may need
    assert llm.engine.drafter.pool_bytes == store_bytes(rows, max_model_len + pad)
    assert llm.engine.drafter.pool_bytes < store_bytes(rows, max_model_len + pad, HEADS)  # not the query heads
    assert llm.context_length == max_model_len


def test_memory_estimate_counts_the_kv_store_before_reading_weights(folder, monkeypatch):
    seen = []
    monkeypatch.setattr(loader, "check_memory", seen.append)
    model = load_any(folder, max_num_seqs=3, max_model_len=40)
    weights = sum(p.numel() * 4 for p in model.parameters())
    assert seen[0].kv_cache_bytes == store_bytes(3, 40) == kv_cache_bytes(model.arch, 3, 40, torch.float32)
    assert seen[0].need_bytes == weights + store_bytes(3, 40)
    load_any(folder, max_num_seqs=3)  # default: the model's context (64 tokens, under the CPU cap)
    assert seen[1].kv_cache_bytes == store_bytes(3, CONTEXT)
    load_any(folder)  # no engine: the weights only
    assert seen[2].kv_cache_bytes == 0 and seen[2].need_bytes == weights


def test_a_kv_store_that_does_not_fit_is_refused_naming_it(folder, monkeypatch):
    model = load_any(folder)
    weights = sum(p.numel() * 4 for p in model.parameters())
    monkeypatch.setattr(loader, "available_bytes", lambda device: weights + store_bytes(8, 32))
    with pytest.raises(CheckpointError, match="not enough memory.*KV store.*--max-model-len"):
        LLM(folder, max_num_seqs=8)  # 64 tokens per row do not fit
    assert LLM(folder, max_num_seqs=8, max_model_len=32).context_length == 32


def test_default_is_the_context_capped_on_a_cpu():
    assert resolve_max_model_len(None, 64, "cpu") == 64
    assert resolve_max_model_len(None, 32768, "cpu") == CPU_MAX_MODEL_LEN == 4096
    assert resolve_max_model_len(None, 32768, torch.device("cuda")) == 32768
    assert resolve_max_model_len(1000, 32768, "cpu") == 1000
    with pytest.raises(ValueError, match="max_model_len 65 exceeds this model's context window of 64 tokens"):
        resolve_max_model_len(65, 64, "cpu")


def test_requests_past_max_model_len_get_the_context_length_error(folder):
    from celeris.serve.serving import OpenAIServing

    llm = LLM(folder, max_model_len=16)
    with pytest.raises(ContextLengthError, match="context window is 16 tokens"):
        llm.generate([list(range(10))], llm.default_params(max_tokens=8))
    assert len(llm.generate([list(range(10))], llm.default_params(max_tokens=6))[0].token_ids) <= 6
    assert OpenAIServing(llm).model_card().max_model_len == 16


@pytest.mark.parametrize("command", [["generate", "hi"], ["serve"], ["batch", "run", "in.jsonl", "out.jsonl"]])
def test_max_model_len_past_the_context_is_one_line_and_exit_2(folder, command, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.jsonl").write_text('{"custom_id": "a", "prompt": "hi"}\n')
    argv = command[:1] + (command[1:2] if command[0] != "batch" else command[1:]) + [
        "--model", str(folder), "--max-model-len", "65", "--threads", "1"]
    if command[0] == "batch":
        argv += ["--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("celeris: error: max_model_len 65 exceeds this model's context window of 64 tokens "
                       "(max_position_embeddings); use at most 64")
    assert "Traceback" not in "\n".join(err)
