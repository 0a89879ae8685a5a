"""DFlash training: the loss against a per-block loop, the acceptance walk against DFlash's decoding loop."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from celeris.models.dflash import DraftKVCache
from celeris.train.dflash import Row, acceptance, batch_tensors, dflash_loss
from tests.models.test_dflash import full_pass, tiny


def test_the_loss_is_the_decayed_cross_entropy_of_every_block_position():
    model = tiny(block_size=4)
    embed = torch.randn(50, 32)
    rows = [Row(torch.randint(0, 50, (14,)), 5, torch.randn(13, 64)),
            Row(torch.randint(0, 50, (10,)), 6, torch.randn(9, 64))]
    gen = torch.Generator().manual_seed(0)
    ids, feats, anchors, valid = batch_tensors(rows, 3, 4, 3, gen)
    lengths = torch.tensor([14, 10])
    loss, _ = dflash_loss(model, embed, ids, feats.float(), anchors, valid, lengths, 2.0, None)
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
                    num += w * float(F.cross_entropy((hidden[k] @ embed.T)[None], r.ids[a + k][None]))
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
