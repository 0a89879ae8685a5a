"""Training objectives: masked-diffusion ELBO on masked positions only; next-token loss for causal twins."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from celeris.train.objective import OBJECTIVES, autoregressive_loss, masked_diffusion_loss


@pytest.fixture
def batch():
    torch.manual_seed(0)
    return torch.randint(3, 64, (3, 16))


def test_diffusion_loss_matches_hand_computation(model, batch):
    """Same noise draws, but the head computed everywhere: the loss must equal CE at masked positions / t."""
    eps = 1e-3
    loss, count = masked_diffusion_loss(model, batch, torch.Generator().manual_seed(7), eps=eps)
    gen = torch.Generator().manual_seed(7)
    b, length = batch.shape
    t = torch.rand(b, 1, generator=gen) * (1 - eps) + eps
    is_masked = torch.rand(b, length, generator=gen) < t
    noisy = torch.where(is_masked, model.config.mask_token_id, batch)
    with torch.no_grad():
        logits = model(noisy)  # (B, L, V)
    ce = F.cross_entropy(logits.flatten(0, 1), batch.flatten(), reduction="none").view(b, length)
    expected = (ce / t * is_masked).sum() / (b * length)
    assert count == int(is_masked.sum()) > 0
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(loss) and loss > 0


def test_diffusion_loss_head_only_on_masked_positions(model, batch, monkeypatch):
    seen: dict[str, object] = {}
    hidden_states, logits = model.hidden_states, model.logits

    def spy_hidden(ids, *a, **k):
        seen["noisy"] = ids.clone()
        return hidden_states(ids, *a, **k)

    def spy_logits(h):
        seen["head_rows"] = h.shape
        return logits(h)

    monkeypatch.setattr(model, "hidden_states", spy_hidden)
    monkeypatch.setattr(model, "logits", spy_logits)
    loss, count = masked_diffusion_loss(model, batch, torch.Generator().manual_seed(1))
    noisy = seen["noisy"]
    is_masked = noisy == model.config.mask_token_id
    assert seen["head_rows"] == (count, model.config.hidden_size)
    assert int(is_masked.sum()) == count
    assert torch.equal(noisy[~is_masked], batch[~is_masked])  # unmasked tokens are the clean ones
    assert torch.isfinite(loss)


def test_diffusion_loss_gradients_and_determinism(make_model, batch):
    m = make_model().train()
    a, _ = masked_diffusion_loss(m, batch, torch.Generator().manual_seed(3))
    b, _ = masked_diffusion_loss(m, batch, torch.Generator().manual_seed(3))
    c, _ = masked_diffusion_loss(m, batch, torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and not torch.equal(a, c)
    a.backward()
    grads = [p.grad for p in m.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert m.embed_tokens.weight.grad.abs().sum() > 0


def test_diffusion_mask_rate_spans_noise_levels(model):
    """t ~ U(eps, 1] per sequence: over many sequences the masked fraction averages about one half."""
    ids = torch.randint(3, 64, (64, 32))
    _, count = masked_diffusion_loss(model, ids, torch.Generator().manual_seed(0))
    assert 0.35 < count / ids.numel() < 0.65


def test_autoregressive_loss_requires_causal(model, batch):
    with pytest.raises(ValueError, match="is_causal"):
        autoregressive_loss(model, batch)


def test_autoregressive_loss_is_next_token_ce(make_model, batch):
    causal = make_model(is_causal=True)
    loss, count = autoregressive_loss(causal, batch)
    with torch.no_grad():
        logits = causal(batch)[:, 1:]  # forward's row i predicts token i (scored from the state at i - 1)
    expected = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    torch.testing.assert_close(loss.detach(), expected)
    assert count == batch.shape[0] * (batch.shape[1] - 1)
    assert torch.isfinite(loss)


def test_every_objective_trains_a_causal_model(make_model, batch):
    """Each registered objective gives a finite loss whose gradient reaches the weights (the CLI's
    ``--objective`` choices are these names)."""
    from celeris.cli import build_parser

    choices = next(a for a in build_parser()._subparsers._group_actions[0].choices["train"]._actions
                   if a.dest == "objective").choices
    # and dflash, which trains a drafter for a frozen target instead (celeris.train.dflash; tests/train/test_dflash*)
    assert sorted(choices) == sorted([*OBJECTIVES, "dflash"])
    for name, fn in OBJECTIVES.items():
        model = make_model(is_causal=True).train()
        loss, count = fn(model, batch, torch.Generator().manual_seed(0))[:2]
        loss.backward()
        assert torch.isfinite(loss) and count > 0, name
        assert model.layers[0].mlp.down_proj.weight.grad.abs().sum() > 0, name


def test_diffusion_loss_clean_prefix(model, monkeypatch):
    """prefix_prob=1: every row keeps a clean prefix (at least its first token) and masks only after it;
    prefix_prob=0 draws exactly the unconditional masks."""
    torch.manual_seed(0)
    batch = torch.randint(3, 64, (64, 16))
    seen: list[torch.Tensor] = []
    hidden_states = model.hidden_states

    def spy(ids, *a, **k):
        seen.append(ids.clone())
        return hidden_states(ids, *a, **k)

    monkeypatch.setattr(model, "hidden_states", spy)
    masked_diffusion_loss(model, batch, torch.Generator().manual_seed(3), prefix_prob=1.0)
    is_masked = seen[-1] == model.config.mask_token_id
    assert not is_masked[:, 0].any()
    first_masked = torch.where(is_masked.any(1), is_masked.float().argmax(1), 16)
    # a clean prefix of varying length: masks start at different columns across rows
    assert len(set(first_masked.tolist())) > 3
    masked_diffusion_loss(model, batch, torch.Generator().manual_seed(3), prefix_prob=0.0)
    masked_diffusion_loss(model, batch, torch.Generator().manual_seed(3))
    assert torch.equal(seen[-1], seen[-2])
    assert (seen[-1] == model.config.mask_token_id)[:, 0].any()  # without prefixes the first column gets masked


def test_prefix_prob_is_validated():
    from celeris.train.loop import TrainConfig

    with pytest.raises(ValueError, match="prefix_prob"):
        TrainConfig(data_dir="d", out_dir="o", prefix_prob=1.5)
    with pytest.raises(ValueError, match="prefix_prob"):
        TrainConfig(data_dir="d", out_dir="o", objective="ar", prefix_prob=0.5)


# ---------------------------------------------------------------------------------------------
# hybrid objective (BD3-LM layout, clean stream causal): the training layout is the inference contract


def test_hybrid_layout_equals_incremental_inference(make_model):
    """Clean stream == the causal model's own forward; each fully masked noisy block == what verified
    decoding computes for the true prefix followed by that many mask slots (one pass, block-bidirectional)."""
    from celeris.engine.verified import VerifiedDecoder
    from celeris.sampling.params import SamplingParams
    from celeris.train.objective import hybrid_hidden_states

    block = 4
    model = make_model(seed=1, is_causal=True, draft_block_size=block)
    torch.manual_seed(0)
    clean = torch.randint(3, 64, (2, 16))
    noisy = clean.clone()
    noisy[:, 8:12] = model.config.mask_token_id  # block 2 fully masked
    with torch.no_grad():
        hidden = hybrid_hidden_states(model, clean, noisy, block)
        torch.testing.assert_close(hidden[:, :16], model.hidden_states(clean), rtol=0, atol=1e-5)
        train_logits = model.logits(hidden[:, 16 + 8 : 16 + 12])  # slots 8..11 score tokens 9..12
    for b in range(2):
        dec = VerifiedDecoder(model, 1, 32)
        dec.add(clean[b, :8].tolist(), SamplingParams(max_tokens=2, steps=2))
        infer = dec._run(0, 1, fresh=True)[0][0, 8:12]
        keep = infer.isfinite()  # the decoder bans the mask and pad ids
        torch.testing.assert_close(infer[keep], train_logits[b][keep], rtol=1e-4, atol=1e-4)


def test_hybrid_loss_scores_what_the_block_did_not_show(make_model):
    """Slot p scores x_{p+1}: counted when masked in the noisy copy or past the block's end."""
    from celeris.train.objective import hybrid_loss, hybrid_noise

    model = make_model(is_causal=True)
    batch = torch.randint(3, 64, (2, 12))
    gen_seed = 5
    loss, count, parts = hybrid_loss(model, batch, torch.Generator().manual_seed(gen_seed), block_size=4,
                                     full_mask_prob=0.0, return_parts=True)
    is_masked = hybrid_noise(batch, 4, 0.0, torch.Generator().manual_seed(gen_seed))
    targets_hidden = is_masked[:, 1:] | (torch.arange(1, 12) % 4 == 0)[None]
    assert count == batch[:, 1:].numel() + int(targets_hidden.sum())
    assert torch.isfinite(loss) and parts["ntp"] > 0 and parts["masked"] > 0
    with pytest.raises(ValueError, match="causal"):
        hybrid_loss(make_model(), batch)
    full = hybrid_noise(torch.zeros(3, 40, dtype=torch.long), 4, 1.0, torch.Generator().manual_seed(0))
    assert bool(full.all())


def test_hybrid_loss_equals_a_hand_built_cross_entropy(make_model):
    """Both terms rebuilt from the layout's hidden states: NTP on clean x_{p+1}, masked CE on the noisy slots
    whose target x_{p+1} the block did not show (masked there, or past the block's end)."""
    from celeris.train.objective import hybrid_hidden_states, hybrid_loss, hybrid_noise

    model = make_model(seed=2, is_causal=True)
    batch = torch.randint(3, 64, (2, 12))
    block = 4
    _, _, parts = hybrid_loss(model, batch, torch.Generator().manual_seed(9), block_size=block, full_mask_prob=0.3,
                              return_parts=True)
    masked = hybrid_noise(batch, block, 0.3, torch.Generator().manual_seed(9))
    noisy = torch.where(masked, model.config.mask_token_id, batch)
    with torch.no_grad():
        hidden = hybrid_hidden_states(model, batch, noisy, block)
        logits = model.logits(hidden)  # (B, 2L, V)
    ntp, ce, count = [], 0.0, 0
    for b in range(2):
        for p in range(11):
            ntp.append(F.cross_entropy(logits[b, p], batch[b, p + 1]))
            same_block = (p + 1) // block == p // block
            if masked[b, p + 1] or not same_block:
                ce += float(F.cross_entropy(logits[b, 12 + p], batch[b, p + 1]))
                count += 1
    assert parts["ntp"] == pytest.approx(float(torch.stack(ntp).mean()), rel=1e-5)
    assert parts["masked"] == pytest.approx(ce / count, rel=1e-5)


def test_certainty_entropy_counts_only_positions_already_right():
    """dParallel's term: entropy of softmax(z / T) averaged over rows whose argmax is the target; none right -> 0."""
    from celeris.train.objective import certainty_entropy

    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 3.0], [0.5, 0.4, 0.0]], requires_grad=True)
    targets = torch.tensor([0, 1, 0])  # rows 0 and 2 right, row 1 wrong
    got = certainty_entropy(logits, targets, temperature=0.5)

    def entropy(row):
        p = torch.softmax(row / 0.5, dim=-1)
        return float(-(p * p.log()).sum())

    want = (entropy(logits[0].detach()) + entropy(logits[2].detach())) / 2
    assert float(got.detach()) == pytest.approx(want, rel=1e-6)
    got.backward()
    assert logits.grad[1].abs().sum() == 0 and logits.grad[0].abs().sum() > 0
    none_right = certainty_entropy(logits, torch.tensor([1, 0, 1]))
    assert float(none_right.detach()) == 0.0 and none_right.requires_grad
    with pytest.raises(ValueError, match="temperature"):
        certainty_entropy(logits, targets, temperature=0.0)


def test_hybrid_loss_adds_the_weighted_certainty_term(make_model):
    """Same noise draws: loss(weight w) - loss(0) == w * the reported certainty part, and the part equals
    certainty_entropy over the scored drafting slots rebuilt by hand."""
    from celeris.train.objective import certainty_entropy, hybrid_hidden_states, hybrid_loss, hybrid_noise

    model = make_model(seed=3, is_causal=True)
    with torch.no_grad():  # a sharper head so that some drafts are already right
        model.embed_tokens.weight.mul_(8)
    batch = torch.randint(3, 64, (2, 12))
    base, _, _ = hybrid_loss(model, batch, torch.Generator().manual_seed(4), full_mask_prob=0.5, return_parts=True)
    loss, _, parts = hybrid_loss(model, batch, torch.Generator().manual_seed(4), full_mask_prob=0.5,
                                 return_parts=True, certainty_weight=0.3, certainty_temperature=0.7)
    assert float((loss - base).detach()) == pytest.approx(0.3 * parts["certainty"], rel=1e-5, abs=1e-7)
    masked = hybrid_noise(batch, 4, 0.5, torch.Generator().manual_seed(4))
    noisy = torch.where(masked, model.config.mask_token_id, batch)
    with torch.no_grad():
        noisy_h = hybrid_hidden_states(model, batch, noisy, 4)[:, 12:23]
    scored = masked[:, 1:] | (torch.arange(1, 12) % 4 == 0)[None]
    with torch.no_grad():
        want = certainty_entropy(model.logits(noisy_h[scored]), batch[:, 1:][scored], 0.7)
    assert parts["certainty"] == pytest.approx(float(want), rel=1e-5)
