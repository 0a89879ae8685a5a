"""DFlash training: the loss against a per-block loop, the acceptance walk against DFlash's decoding loop."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from celeris.models.dflash import DraftKVCache
from celeris.train.dflash import Row, acceptance, batch_tensors, dflash_loss, init_from_target
from tests.models.test_dflash import full_pass, tiny


def test_the_loss_is_the_decayed_cross_entropy_of_every_block_position():
    """Against a per-block loop; the second row's labels (the target's own greedy tokens after each prefix, where
    another engine wrote the answer) differ from its ids, and the loss trains toward the labels."""
    model = tiny(block_size=4)
    embed = torch.randn(50, 32)
    rows = [Row(torch.randint(0, 50, (14,)), 5, torch.randn(13, 64)),
            Row(torch.randint(0, 50, (10,)), 6, torch.randn(9, 64), torch.randint(0, 50, (10,)))]
    gen = torch.Generator().manual_seed(0)
    ids, labels, feats, anchors, valid = batch_tensors(rows, 3, 4, 3, gen)
    assert torch.equal(labels[1, :10], rows[1].labels) and torch.equal(labels[0, :14], rows[0].ids)
    lengths = torch.tensor([14, 10])
    loss, _ = dflash_loss(model, embed, ids, feats.float(), anchors, valid, lengths, 2.0, None, labels)
    num = den = 0.0
    for b, r in enumerate(rows):
        for a, ok in zip(anchors[b].tolist(), valid[b].tolist(), strict=True):
            if not ok:
                continue
            assert r.prompt_len <= a <= len(r.ids) - 2
            hidden = full_pass(model, embed, r.feats.float(), int(r.ids[a]), a)  # (bs, d)
            for k in range(1, 4):
                if a + k < len(r.ids):
                    w = math.exp(-(k - 1) / 2.0)
                    num += w * float(F.cross_entropy((hidden[k] @ embed.T)[None], r.labels[a + k][None]))
                    den += w
    assert abs(float(loss) - num / den) < 1e-4


def test_acceptance_along_the_greedy_path_equals_dflashs_decoding_loop():
    """The walk over drafts at every start == a loop that drafts with the lagging cache and verifies greedily."""
    model = tiny(block_size=4)
    embed = torch.randn(50, 32)  # also the head, as SmolLM2's tied one
    torch.manual_seed(1)
    ids = torch.randint(0, 50, (30,))
    feats = torch.randn(29, 64)
    # make some drafts right: the "target's" tokens are the drafter's own argmax at some starts
    for s in (8, 9, 15, 16, 17):
        ids[s + 1] = model.draft_logits(full_pass(model, embed, feats, int(ids[s]), s)[None, 1:2], embed).argmax()
    row = Row(ids, 8, feats)
    got = acceptance(model, embed, [row], 3)
    cache, s, seen, lengths = DraftKVCache(), 8, 0, []
    while s < len(ids) - 1:
        drafts = model.draft(ids[s][None], feats[None, seen:s], s, cache, embed, embed)[0]
        truth = ids[s + 1: s + 4]
        accepted = int((drafts[: len(truth)] == truth).long().cumprod(0).sum())
        seen, step = s, min(accepted + 1, len(ids) - s)
        lengths.append(step)
        s += step
    assert got["passes"] == len(lengths) and got["tokens"] == sum(lengths)
    assert max(lengths) >= 2  # the planted matches were accepted


def test_the_warm_start_feeds_the_context_to_the_first_layer_as_the_target_layer_sees_it():
    """fc selects the features of the layer below the first copied layer and hidden_norm is that layer's input norm:
    hidden_norm(fc(features)) == RMSNorm(h) * w, the input of target layer ``layers[0]``'s projections."""
    model = tiny()  # reads target layers [1, 4] of 6
    d = model.config.hidden_size
    state = {}
    for t in (5,):
        pre = f"model.layers.{t}."
        for name, shape in (("q_proj", (32, d)), ("k_proj", (16, d)), ("v_proj", (16, d)), ("o_proj", (d, 32))):
            state[pre + f"self_attn.{name}.weight"] = torch.randn(shape)
        for name, shape in (("gate_proj", (64, d)), ("up_proj", (64, d)), ("down_proj", (d, 64))):
            state[pre + f"mlp.{name}.weight"] = torch.randn(shape)
        state[pre + "input_layernorm.weight"] = torch.rand(d) + 0.5
        state[pre + "post_attention_layernorm.weight"] = torch.rand(d)
    state["model.norm.weight"] = torch.rand(d)
    init_from_target(model, state, [5, 5])
    low, h = torch.randn(7, d), torch.randn(7, d) * 3  # outputs of target layers 1 and 4 at 7 positions
    ctx = model.hidden_norm(model.fc(torch.cat([low, h], dim=-1)))
    expected = F.rms_norm(h, (d,), state["model.layers.5.input_layernorm.weight"], model.config.rms_norm_eps)
    torch.testing.assert_close(ctx, expected)
    layer = model.layers[0].self_attn
    torch.testing.assert_close(layer.v_proj(ctx), expected @ state["model.layers.5.self_attn.v_proj.weight"].T)
    # without the layer below among the features read, fc keeps its random start
    other = tiny()
    before = other.fc.weight.clone()
    init_from_target(other, state | {k.replace("layers.5.", "layers.4."): v for k, v in state.items()}, [4, 5])
    assert torch.equal(other.fc.weight, before)


def test_a_drafter_starts_from_a_trained_one_where_names_and_shapes_match(tmp_path):
    """``--init``: a 3-layer drafter grown from a 2-layer one takes its two layers, fc and norms (bfloat16 from an
    exported folder, exactly from a run's last.pt); its third layer keeps its own start; another width is refused."""
    from dataclasses import replace

    import pytest

    from celeris.models.dflash import DFlashDraftModel, save_dflash
    from celeris.train.dflash import init_from_drafter

    source = tiny()
    with torch.no_grad():
        for p in source.parameters():
            p.normal_()
    save_dflash(source, tmp_path / "export")
    torch.save({"model": source.state_dict(), "step": 7}, tmp_path / "last.pt")
    torch.manual_seed(1)
    deeper = DFlashDraftModel(replace(source.config, num_hidden_layers=3))
    third = {k: v.clone() for k, v in deeper.state_dict().items() if k.startswith("layers.2.")}
    assert init_from_drafter(deeper, tmp_path / "last.pt") == len(source.state_dict())
    got = deeper.state_dict()
    assert all(torch.equal(got[k], v) for k, v in source.state_dict().items())
    assert all(torch.equal(got[k], v) for k, v in third.items())
    init_from_drafter(deeper, tmp_path / "export")
    assert torch.equal(deeper.state_dict()["fc.weight"], source.fc.weight.detach().to(torch.bfloat16).float())
    wider = DFlashDraftModel(replace(source.config, hidden_size=48, num_attention_heads=6))
    with pytest.raises(ValueError, match="hidden size 32 does not fit this drafter.s 48"):
        init_from_drafter(wider, tmp_path / "last.pt")
    with pytest.raises(ValueError, match="no drafter folder or last.pt"):
        init_from_drafter(deeper, tmp_path / "missing")
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    torch.save([1, 2], tmp_path / "list.pt")
    for bad in ("notes.txt", "list.pt"):
        with pytest.raises(ValueError, match="not a training checkpoint"):
            init_from_drafter(deeper, tmp_path / bad)
