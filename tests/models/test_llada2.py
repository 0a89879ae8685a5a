"""LLaDA2.0 (Ling 2.0 mixture of experts): loaded natively from the published format, checked against the published
equations (``modeling_llada2_moe.py``) written here in float64 loops, and decoded by the engine's block path."""

from __future__ import annotations

import json
import math

import pytest
import torch

from celeris.config import EngineConfig
from celeris.engine import Engine
from celeris.models.llada2 import LLaDA2Model
from celeris.models.loader import CheckpointError, load_any
from celeris.reference.block import generate_block
from celeris.sampling.params import SamplingParams
from tests.models.conftest_block_formats import write_llada2
from tests.models.conftest_formats import ref_rms, ref_rope


def reference_logits(state: dict, cfg: dict, ids: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """(L,) ids, (L, L) bool query/key mask -> (L, V) float64 logits, one token and one expert at a time."""
    w = {k: v.double() for k, v in state.items()}
    heads, kv, hd, eps = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["rms_norm_eps"]
    r, length = int(hd * cfg["partial_rotary_factor"]), ids.shape[0]
    positions = torch.arange(length)

    def swiglu(x, p):
        gate = x @ w[p + "gate_proj.weight"].T
        return (gate * torch.sigmoid(gate) * (x @ w[p + "up_proj.weight"].T)) @ w[p + "down_proj.weight"].T

    x = w["model.word_embeddings.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        n = ref_rms(x, w[p + "input_layernorm.weight"], eps)
        qkv = (n @ w[p + "attention.query_key_value.weight"].T).view(length, heads + 2 * kv, hd)
        q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv], qkv[:, heads + kv :]
        q = ref_rms(q, w[p + "attention.query_layernorm.weight"], eps)
        k = ref_rms(k, w[p + "attention.key_layernorm.weight"], eps)
        q = torch.cat([ref_rope(q[..., :r], positions, cfg["rope_theta"]), q[..., r:]], dim=-1)
        k = torch.cat([ref_rope(k[..., :r], positions, cfg["rope_theta"]), k[..., r:]], dim=-1)
        out = torch.zeros(length, heads, hd, dtype=torch.float64)
        for h in range(heads):
            scores = (q[:, h] @ k[:, h // (heads // kv)].T / math.sqrt(hd)).masked_fill(~allowed, float("-inf"))
            out[:, h] = torch.softmax(scores, -1) @ v[:, h // (heads // kv)]
        x = x + out.reshape(length, -1) @ w[p + "attention.dense.weight"].T
        m = ref_rms(x, w[p + "post_attention_layernorm.weight"], eps)
        if i < cfg["first_k_dense_replace"]:
            x = x + swiglu(m, p + "mlp.")
            continue
        y = swiglu(m, p + "mlp.shared_experts.")
        for t in range(length):  # the published gate: float32 sigmoid scores, group-limited top-k on score + bias
            scores = torch.sigmoid(m[t].float() @ state[p + "mlp.gate.weight"].float().T)
            routing = scores + state[p + "mlp.gate.expert_bias"].float()
            groups = routing.view(cfg["n_group"], -1)
            kept = groups.topk(2, dim=-1).values.sum(-1).topk(cfg["topk_group"]).indices.tolist()
            allowed_experts = [e for e in range(cfg["num_experts"]) if e // groups.shape[1] in kept]
            chosen = sorted(allowed_experts, key=lambda e: -routing[e].item())[: cfg["num_experts_per_tok"]]
            weights = scores[chosen] / (scores[chosen].sum() + 1e-20) * cfg["routed_scaling_factor"]
            for e, wt in zip(chosen, weights.tolist(), strict=True):
                y[t] = y[t] + wt * swiglu(m[t], f"{p}mlp.experts.{e}.")
        x = x + y
    return ref_rms(x, w["model.norm.weight"], eps) @ w["lm_head.weight"].T


@pytest.fixture(scope="module")
def llada2_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llada2") / "LLaDA2-tiny"
    cfg, state = write_llada2(folder, num_shards=2)
    return folder, cfg, state


def test_logits_match_the_published_equations_with_the_block_mask(llada2_dir):
    folder, cfg, state = llada2_dir
    model = load_any(folder, dtype=torch.float64)
    assert isinstance(model, LLaDA2Model) and model.block_contract.block_size == 32
    ids = torch.randint(3, cfg["vocab_size"], (10,), generator=torch.Generator().manual_seed(0))
    blocks = torch.arange(10) // 4
    allowed = blocks[None, :] <= blocks[:, None]  # block-causal, blocks of 4
    hidden = model.hidden_states(ids[None], layout_mask=allowed[None, None])
    torch.testing.assert_close(model.logits(hidden)[0].double(), reference_logits(state, cfg, ids, allowed),
                               atol=1e-5, rtol=1e-5)


def test_engine_equals_reference_block_sampler(tmp_path):
    write_llada2(tmp_path / "m", scale=3.0)
    model = load_any(tmp_path / "m", dtype=torch.float64)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30,
                           31, 32, 33, 34, 35, 36, 37, 38, 39, 40]]
    for params in (SamplingParams(**model.block_contract.defaults | {"max_tokens": 40}),
                   SamplingParams(max_tokens=12, block_length=8, steps=4, decoding="threshold", threshold=0.3)):
        ref = generate_block(model, prompts, params)
        engine = Engine(model, EngineConfig())
        requests = [engine.add_request(p, params) for p in prompts]
        while engine.has_unfinished():
            engine.step()
        assert [r.answer.tolist() for r in requests] == ref.answer_ids.tolist()


def test_unsupported_router_is_refused(tmp_path):
    write_llada2(tmp_path / "a", score_function="softmax")
    with pytest.raises(CheckpointError, match="score_function"):
        load_any(tmp_path / "a")


@pytest.mark.parametrize("key, value", [("use_qk_norm", False), ("norm_head", True), ("use_qk_norm", 1)])
def test_config_values_the_model_does_not_compute_are_refused_naming_them(tmp_path, key, value):
    """Issue 28 item 11: ``use_qk_norm: false`` (no q/k RMSNorm) and ``norm_head: true`` (an L2-normalised head)
    were loaded and computed as the defaults; the published values load."""
    write_llada2(tmp_path / "a", **{key: value})
    with pytest.raises(CheckpointError, match=f"{key} {json.dumps(value)} \\(only "):
        load_any(tmp_path / "a")
    write_llada2(tmp_path / "b", use_qk_norm=True, norm_head=False)
    assert isinstance(load_any(tmp_path / "b"), LLaDA2Model)
