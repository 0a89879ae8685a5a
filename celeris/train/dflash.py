"""Training a DFlash drafter for a frozen target on the target's own answers (``python -m celeris.train.dflash``).

The objective is DFlash's (arXiv:2602.06036; NVIDIA Model-Optimizer's DFlash recipe: several anchors per answer,
loss weights decaying along the block, gamma 4 for blocks of 8): for an answer position a (an anchor), the block is
the token at a followed by ``block_size - 1`` mask tokens, the context is the target's hidden states at every
position before a, and position a + k of the block is trained to predict the target's token there (the data are
the target's own greedy answers, so these are its argmax tokens) with cross-entropy weighted ``exp(-(k - 1) / gamma)``.
All anchors of a row go through one forward pass: block i's queries see the context keys j < a_i and the keys of
their own block only (``anchor_layout``).

The data are the shards of ``scripts/drafter_data.py`` (token ids and the target's hidden states at the drafter's
``target_layer_ids``), so training never runs the target. Checkpoints (``last.pt``: drafter, optimiser, step) let a
run resume after any interruption; every ``--eval-every`` steps the acceptance curve on held-out rows is measured
(``acceptance``) and logged to ``history.jsonl``, and the drafter is exported (``save_dflash``).
"""

from __future__ import annotations

import argparse
import json
import math
import pickle
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from celeris.models.dflash import DFlashConfig, DFlashDraftModel, save_dflash
from celeris.train.ship import parse_duration, prior_steps, ship_if_better


@dataclass
class Row:
    """One training sequence: ``ids`` (L,) int64 prompt + answer, ``prompt_len`` P, ``feats`` (L - 1, n * d) float16,
    ``labels`` (L,) int64: the target's greedy token at each position given the ids before it (``ids`` itself where
    the answer is the target's own greedy text; position 0 is never a label)."""

    ids: torch.Tensor
    prompt_len: int
    feats: torch.Tensor
    labels: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.labels is None:
            self.labels = self.ids


def load_rows(folder: Path, layer_ids: list[int], stored: list[int], max_rows: int = 0) -> list[Row]:
    """Rows of every complete shard in ``folder`` (``answers.jsonl`` names them), features cut to ``layer_ids``.

    ``stored`` are the target layers the shards hold (``LAYER_IDS`` of the data script); ``layer_ids`` must be among them.
    """
    from safetensors.torch import load_file

    missing = [i for i in layer_ids if i not in stored]
    if missing:
        raise ValueError(f"target layers {missing} are not in the data (it holds {stored})")
    lines = [json.loads(x) for x in (folder / "answers.jsonl").read_text().splitlines() if x.strip()]
    rows, shards = [], {}
    for line in lines[: max_rows or None]:
        shard = shards.get(line["shard"]) or shards.setdefault(line["shard"], load_file(folder / line["shard"]))
        feats = shard[f"feat_{line['row']}"]
        d = feats.shape[1] // len(stored)
        parts = [feats[:, stored.index(i) * d:(stored.index(i) + 1) * d] for i in layer_ids]
        ids = shard[f"ids_{line['row']}"].long()
        labels = None  # Row: the ids themselves
        if f"lab_{line['row']}" in shard:  # answers another engine wrote: the target's own next token after each prefix
            labels = torch.cat([ids[:1], shard[f"lab_{line['row']}"].long()])
        rows.append(Row(ids, line["prompt_len"], torch.cat(parts, -1), labels))
    return rows


def anchor_layout(length: int, anchors: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE positions and the attention mask of one training pass with A blocks per row.

    Args:
        length: context positions L (keys 0..L-1 are the target's features at those positions).
        anchors: (B, A) int64 block starts a_i.
        block_size: tokens per block bs.
    Returns:
        positions (B, L + A * bs) int64: 0..L-1 for the context, a_i..a_i + bs - 1 for block i;
        mask (B, 1, A * bs, L + A * bs) bool: block i's queries see context keys j < a_i and their own block.
    """
    b, a = anchors.shape
    dev = anchors.device
    offs = torch.arange(block_size, device=dev)
    block_pos = (anchors[:, :, None] + offs).reshape(b, a * block_size)  # (B, A*bs)
    positions = torch.cat([torch.arange(length, device=dev).expand(b, length), block_pos], dim=1)
    ctx = torch.arange(length, device=dev)[None, None, :] < anchors[:, :, None]  # (B, A, L)
    ctx = ctx[:, :, None, :].expand(b, a, block_size, length).reshape(b, a * block_size, length)
    own = torch.block_diag(*[torch.ones(block_size, block_size, dtype=torch.bool, device=dev)] * a)  # (A*bs, A*bs)
    mask = torch.cat([ctx, own.expand(b, -1, -1)], dim=2)
    return positions, mask[:, None]


def batch_tensors(rows: list[Row], anchors_per_row: int, block_size: int, mask_id: int, generator: torch.Generator):
    """Pad a batch and draw its anchors: (ids (B, L), labels (B, L), feats (B, L, n*d), anchors (B, A), valid (B, A)
    bool).

    Anchors are answer positions a in [P, L - 2] (the block's first token is known, at least one later token is a
    label), drawn without replacement; rows with fewer candidates repeat some (``valid`` False for the repeats).
    """
    length = max(len(r.ids) for r in rows)
    b, d = len(rows), rows[0].feats.shape[1]
    ids = torch.full((b, length), mask_id, dtype=torch.long)
    labels = ids.clone()
    feats = torch.zeros(b, length, d, dtype=torch.float16)
    anchors = torch.zeros(b, anchors_per_row, dtype=torch.long)
    valid = torch.zeros(b, anchors_per_row, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, : len(r.ids)], labels[i, : len(r.ids)] = r.ids, r.labels
        feats[i, : len(r.feats)] = r.feats
        cand = torch.arange(r.prompt_len, len(r.ids) - 1)
        pick = cand[torch.randperm(len(cand), generator=generator)[:anchors_per_row]]
        anchors[i, : len(pick)], valid[i, : len(pick)] = pick, True
        if 0 < len(pick) < anchors_per_row:
            anchors[i, len(pick):] = pick[0]
    return ids, labels, feats, anchors, valid


def dflash_loss(model: DFlashDraftModel, embed: torch.Tensor, ids: torch.Tensor, feats: torch.Tensor,
                anchors: torch.Tensor, valid: torch.Tensor, lengths: torch.Tensor, gamma: float,
                t2d: torch.Tensor | None, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """DFlash's weighted cross-entropy over every drafted position of every anchor.

    Args:
        embed: the target's (V, d) embedding matrix (also its head: SmolLM2 ties them).
        ids (B, L), feats (B, L, n*d), anchors/valid (B, A), lengths (B,): real tokens per row.
        targets: (B, L) the target's greedy token at each position (``Row.labels``); None: ``ids``.
        t2d: (V,) int64 target id -> draft-vocabulary row, -1 outside it (None: the full vocabulary).
    Returns:
        (loss, stats): stats holds ``acc@k`` (top-1 accuracy at block position k) and the label coverage.
    """
    cfg = model.config
    bs, (b, a) = cfg.block_size, anchors.shape
    dev = ids.device  # every tensor on the batch's device (a GPU step: celeris.train.gpu_drafter)
    block = torch.full((b, a, bs), cfg.mask_token_id, dtype=torch.long, device=dev)
    block[:, :, 0] = ids.gather(1, anchors)
    label_pos = anchors[:, :, None] + torch.arange(1, bs, device=dev)  # (B, A, bs-1)
    in_row = label_pos < lengths[:, None, None]
    targets = ids if targets is None else targets
    labels = targets.gather(1, label_pos.clamp(max=ids.shape[1] - 1).reshape(b, -1)).reshape(b, a, bs - 1)
    positions, mask = anchor_layout(ids.shape[1], anchors, bs)
    hidden = model(F.embedding(block.reshape(b, a * bs), embed), feats, positions, attn_mask=mask)
    hidden = hidden.reshape(b, a, bs, -1)[:, :, 1:]  # (B, A, bs-1, d)
    logits = model.draft_logits(hidden, embed)  # (B, A, bs-1, V_draft)
    target = labels if t2d is None else t2d[labels]
    ok = in_row & valid[:, :, None] & (target >= 0)
    weights = torch.exp(-torch.arange(bs - 1, dtype=torch.float32, device=dev) / gamma).expand_as(ok) * ok
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.clamp(min=0).reshape(-1), reduction="none")
    loss = (ce * weights.reshape(-1)).sum() / weights.sum().clamp(min=1e-9)
    with torch.no_grad():
        right = (logits.argmax(-1) == target) & ok
        stats = {f"acc@{k + 1}": round(float(right[..., k].sum() / ok[..., k].sum().clamp(min=1)), 4)
                 for k in sorted({0, 1, 3, bs - 2}) if k < bs - 1}
        stats["coverage"] = round(float(ok.sum() / (in_row & valid[:, :, None]).sum().clamp(min=1)), 4)
    return loss, stats


@torch.no_grad()
def row_drafts(model: DFlashDraftModel, embed: torch.Tensor, row: Row, num_drafts: int,
               head: torch.Tensor | torch.nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's greedy drafts at every start of ``row``'s answer, from masked passes of 64 blocks each
    (``anchor_layout``): for start s (``row.prompt_len`` <= s < L - 1) the block ``[ids[s], mask ...]`` with the
    context features of positions before s, scored by ``head`` (``DFlashDraftModel.draft_logits``; default: the
    tied table ``embed``).

    Returns:
        drafts (L - 1 - P, num_drafts) int64 target ids and their probabilities (same shape, float32): the softmax
        over the draft vocabulary at each block position (the drafter's confidence in its argmax).
    """
    length = len(row.ids)
    starts = torch.arange(row.prompt_len, length - 1)
    drafts, confidence = [], []
    for chunk in starts.split(64):  # bounded memory: 64 blocks per pass
        positions, mask = anchor_layout(length - 1, chunk[None], model.config.block_size)
        block = torch.full((1, len(chunk), model.config.block_size), model.config.mask_token_id)
        block[:, :, 0] = row.ids[chunk]
        hidden = model(F.embedding(block.reshape(1, -1), embed), row.feats[None], positions, attn_mask=mask)
        hidden = hidden.reshape(1, len(chunk), model.config.block_size, -1)[0, :, 1:1 + num_drafts]
        probs, best = model.draft_logits(hidden, embed if head is None else head).softmax(-1).max(-1)
        drafts.append(model.d2t[best])
        confidence.append(probs)
    return torch.cat(drafts), torch.cat(confidence)


def walk(row: Row, drafts: torch.Tensor, keep: torch.Tensor | None = None) -> list[tuple[int, int, int]]:
    """The passes of DFlash's decoding loop at temperature 0 along ``row``'s greedy answer: (drafts verified,
    accepted, tokens committed) per pass. A pass starting at s verifies ``drafts[s - P]`` (all of them, or its
    first ``keep[s - P]``) and the target keeps the longest prefix equal to its tokens plus one of its own, so the
    next starts at s + accepted + 1."""
    length, out, s = len(row.ids), [], row.prompt_len
    while s < length - 1:
        n = drafts.shape[1] if keep is None else int(keep[s - row.prompt_len])
        truth = row.labels[s + 1: s + 1 + n]
        accepted = int((drafts[s - row.prompt_len, : len(truth)] == truth).long().cumprod(0).sum())
        step = min(accepted + 1, length - s)
        out.append((n, accepted, step))
        s += step
    return out


@torch.no_grad()
def acceptance(model: DFlashDraftModel, embed: torch.Tensor, rows: list[Row], num_drafts: int) -> dict:
    """Acceptance along the target's greedy path, as DFlash's decoding loop would see it at temperature 0.

    For a held-out row (the target's own greedy answer), a verified pass starting at s drafts positions s+1..s+k
    from the context [0, s); the target accepts the longest prefix equal to its tokens plus one of its own, so the
    next pass starts at s + accepted + 1. The drafts at every s come from one masked pass (``row_drafts``), and
    walking the path (``walk``) gives each pass's acceptance length; the real loop computes the same (its drafter
    cache holds exactly the context before s) up to the float noise of incremental hidden states.

    Returns:
        {"tau": mean tokens per target pass, "passes": n, "tokens": n, "per_position": acceptance rate at draft k}.
    """
    passes = tokens = 0
    reach = torch.zeros(num_drafts)
    for r in rows:
        for _, accepted, step in walk(r, row_drafts(model, embed, r, num_drafts)[0]):
            reach[:accepted] += 1
            passes += 1
            tokens += step
    return {"tau": round(tokens / max(passes, 1), 3), "passes": passes, "tokens": tokens,
            "per_position": [round(float(x) / max(passes, 1), 3) for x in reach]}


def draft_vocabulary(rows: list[Row], size: int, vocab_size: int, keep: list[int]) -> torch.Tensor:
    """The ``size`` most frequent target ids in the rows (plus ``keep``), ascending: the ``d2t`` map.

    Answer tokens count twice, prompt tokens once: answers are what gets drafted, and prompts (which answers often
    quote) fill the ranks that a few hundred answers leave empty."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for r in rows:
        counts += torch.bincount(r.ids[r.prompt_len:], minlength=vocab_size) + torch.bincount(r.ids, minlength=vocab_size)
    counts[keep] = counts.max() + 1
    return counts.topk(size).indices.sort().values


def pick_vocabulary(model: DFlashDraftModel, rows: list[Row], size: int, keep: list[int]) -> torch.Tensor | None:
    """Set ``model.d2t`` to the draft vocabulary of ``rows`` (``draft_vocabulary``) and return ``t2d`` (V,) int64
    (target id -> draft row, -1 outside), or leave the full vocabulary and return None when ``size`` is 0.

    No parameter depends on the choice (the drafter is scored by the target's own head rows ``d2t`` selects), so a
    run picks it again whenever its rows change, and a resumed run from the rows it has then."""
    if not size:
        return None
    model.d2t = draft_vocabulary(rows, size, model.config.vocab_size, keep)
    return target_to_draft(model.d2t, model.config.vocab_size)


def target_to_draft(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``t2d`` (V,) int64 on ``d2t``'s device: target id -> its row of the draft vocabulary ``d2t``, -1 outside."""
    t2d = torch.full((vocab_size,), -1, dtype=torch.long, device=d2t.device)
    t2d[d2t] = torch.arange(d2t.numel(), device=d2t.device)
    return t2d


def init_from_target(model: DFlashDraftModel, target_state: dict[str, torch.Tensor], layers: list[int]) -> None:
    """Start drafter layer i from target layer ``layers[i]`` (Llama names; q/k norms stay ones): a warm start.

    When the target layer just below ``layers[0]`` is one the drafter reads, ``fc`` starts as the selection of that
    layer's features and ``hidden_norm`` as ``layers[0]``'s input norm: the context then enters the first drafter
    layer's ``k_proj`` / ``v_proj`` exactly as the target's layer ``layers[0]`` sees it (the normed output of the
    layer below), so its context values start as that layer's own (its keys too, up to the drafter's per-head
    ``k_norm``); the other layers' features start with zero weight and are learnt.
    """
    ids = list(model.config.target_layer_ids)
    if layers and layers[0] - 1 in ids:
        d = model.config.hidden_size
        j = ids.index(layers[0] - 1)
        model.fc.weight.data.zero_()
        model.fc.weight.data[:, j * d:(j + 1) * d] = torch.eye(d)
        model.hidden_norm.weight.data.copy_(target_state[f"model.layers.{layers[0]}.input_layernorm.weight"])
    for i, t in enumerate(layers):
        pre = f"model.layers.{t}."
        own = model.layers[i]
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(own.self_attn, name).weight.data.copy_(target_state[pre + f"self_attn.{name}.weight"])
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(own.mlp, name).weight.data.copy_(target_state[pre + f"mlp.{name}.weight"])
        own.input_layernorm.weight.data.copy_(target_state[pre + "input_layernorm.weight"])
        own.post_attention_layernorm.weight.data.copy_(target_state[pre + "post_attention_layernorm.weight"])
    model.norm.weight.data.copy_(target_state["model.norm.weight"])


def init_from_drafter(model: DFlashDraftModel, source: Path) -> int:
    """Start ``model`` from a trained drafter (a fine-tune, or a deeper drafter grown from a shallower one): every
    parameter whose name and shape match one of ``source``'s is copied; the rest keep their start
    (``init_from_target``). ``source`` is an exported drafter folder (``save_dflash``: bfloat16 weights) or a run's
    ``last.pt`` (float32, the optimiser's state is not taken: the new run starts its own schedule).

    Returns:
        the number of tensors copied.

    Raises:
        ValueError: ``source`` is neither a drafter folder nor a training checkpoint (``last.pt``), or its hidden
            size is not ``model``'s.
    """
    from celeris.models.dflash import load_dflash

    if source.is_file():
        try:
            ckpt = torch.load(source, weights_only=False, map_location="cpu")
        except (RuntimeError, EOFError, pickle.UnpicklingError) as exc:
            raise ValueError(f"--init {source}: not a training checkpoint ({exc})") from exc
        if not isinstance(ckpt, dict) or not isinstance(ckpt.get("model"), dict):
            raise ValueError(f"--init {source}: not a training checkpoint (no 'model' state in it)")
        state = ckpt["model"]
    elif source.is_dir():
        state = load_dflash(source).state_dict()
    else:
        raise ValueError(f"--init {source}: no drafter folder or last.pt there")
    own = model.state_dict()
    width = tuple(state["norm.weight"].shape) if "norm.weight" in state else None  # (hidden size,)
    if width != tuple(own["norm.weight"].shape):
        raise ValueError(f"--init {source}: its hidden size {width[0] if width else '(none)'} does not fit this "
                         f"drafter's {model.config.hidden_size}")
    shared = {k: v for k, v in state.items() if k in own and v.shape == own[k].shape}
    with torch.no_grad():
        for k, v in shared.items():
            own[k].copy_(v.to(own[k].dtype))
    return len(shared)


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m celeris.train.dflash`` (``celeris train --objective dflash`` wraps it)."""
    ap = argparse.ArgumentParser(description="Train a DFlash drafter on a frozen target's own answers.")
    ap.add_argument("--data", type=Path, required=True, help="scripts/drafter_data.py output (training rows)")
    ap.add_argument("--heldout", type=Path, required=True, help="the same, for held-out prompts (acceptance)")
    ap.add_argument("--target", type=Path, required=True, help="the target's HF folder (config.json + safetensors)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--target-layer-ids", default="1,15,27")
    ap.add_argument("--stored-layer-ids", default="1,15,27")
    ap.add_argument("--mask-token-id", type=int, default=16)
    ap.add_argument("--draft-vocab", type=int, default=0,
                    help="a pruned draft vocabulary of this many most frequent answer ids; 0: the full target vocabulary")
    ap.add_argument("--gamma", type=float, default=4.0)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--anchors", type=int, default=32)
    ap.add_argument("--max-steps", type=int, default=20000)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--eval-rows", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--init", type=Path, help="start from this trained drafter (folder or last.pt; "
                    "init_from_drafter) instead of the target's last layers alone; ignored when the run resumes")
    ap.add_argument("--time-budget", help="stop after this much wall-clock time (90s, 30m, 2h; celeris.train.ship) "
                    "or at --max-steps, whichever comes first")
    ap.add_argument("--ship", type=Path, help="at the end, replace the drafter in this folder by the trained one "
                    "only if it accepts more on the held-out rows (celeris.train.ship.ship_if_better)")
    ap.add_argument("--record-command", help=argparse.SUPPRESS)  # `celeris train` gives the command as typed
    return ap


def drafter_config(tcfg: dict, args: argparse.Namespace, layer_ids: list[int]) -> DFlashConfig:
    """The drafter's config from the target's ``config.json`` fields (``tcfg``) and the command line."""
    rope = (tcfg.get("rope_parameters") or {}).get("rope_theta", tcfg.get("rope_theta", 10000.0))
    return DFlashConfig(hidden_size=tcfg["hidden_size"], intermediate_size=tcfg["intermediate_size"],
                        num_hidden_layers=args.draft_layers, num_attention_heads=tcfg["num_attention_heads"],
                        num_key_value_heads=tcfg["num_key_value_heads"], head_dim=tcfg.get("head_dim") or 64,
                        vocab_size=tcfg["vocab_size"], num_target_layers=tcfg["num_hidden_layers"],
                        block_size=args.block_size, rms_norm_eps=tcfg["rms_norm_eps"], rope_theta=float(rope),
                        max_position_embeddings=tcfg["max_position_embeddings"], mask_token_id=args.mask_token_id,
                        target_layer_ids=layer_ids, draft_vocab=args.draft_vocab)


def train_step(model: DFlashDraftModel, opt: torch.optim.Optimizer, embed: torch.Tensor, rows: list[Row],
               t2d: torch.Tensor | None, step: int, lr: float, batch_size: int, anchors: int, gamma: float,
               seed: int) -> tuple[torch.Tensor, dict]:
    """One optimiser step at learning rate ``lr`` on ``batch_size`` rows drawn as a function of (``seed``, ``step``)
    (so a resumed run draws what the uninterrupted one would), ``anchors`` blocks a row, on the device of
    ``embed`` (the model's). Returns ``dflash_loss``'s (loss, stats)."""
    model.train()
    cfg = model.config
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    batch = [rows[i] for i in torch.randint(len(rows), (batch_size,), generator=gen).tolist()]
    ids, labels, feats, starts, valid = batch_tensors(batch, anchors, cfg.block_size, cfg.mask_token_id, gen)
    lengths = torch.tensor([len(r.ids) for r in batch])
    ids, labels, feats, starts, valid, lengths = (t.to(embed.device) for t in (ids, labels, feats, starts, valid,
                                                                                lengths))
    for g in opt.param_groups:
        g["lr"] = lr
    loss, stats = dflash_loss(model, embed, ids, feats.float(), starts, valid, lengths, gamma, t2d, labels)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss, stats


def _save(model: DFlashDraftModel, opt: torch.optim.Optimizer, t2d: torch.Tensor | None, step: int,
          args: argparse.Namespace) -> None:
    """``out/last.pt`` written whole or not at all (a temporary file renamed over it)."""
    tmp = args.out / "last.pt.tmp"
    torch.save({"model": model.state_dict(), "d2t": model.d2t, "t2d": t2d, "optimizer": opt.state_dict(),
                "step": step, "args": vars(args) | {k: str(v) for k, v in vars(args).items() if isinstance(v, Path)}},
               tmp)
    tmp.replace(args.out / "last.pt")


def main(argv: list[str] | None = None) -> None:
    """Train (or resume) a drafter; see the module docstring."""
    args = build_parser().parse_args(argv)
    budget_s = parse_duration(args.time_budget) if args.time_budget else math.inf
    torch.set_num_threads(args.threads)
    from safetensors.torch import load_file

    tcfg = json.loads((args.target / "config.json").read_text())
    tstate = load_file(args.target / "model.safetensors")
    embed = tstate["model.embed_tokens.weight"].float()  # (V, d), frozen
    layer_ids = [int(x) for x in args.target_layer_ids.split(",")]
    stored = [int(x) for x in args.stored_layer_ids.split(",")]
    data_size = (args.data / "answers.jsonl").stat().st_size
    rows = load_rows(args.data, layer_ids, stored)
    held = load_rows(args.heldout, layer_ids, stored, args.eval_rows)
    cfg = drafter_config(tcfg, args, layer_ids)
    torch.manual_seed(args.seed)
    model = DFlashDraftModel(cfg)
    keep = [tcfg.get("eos_token_id", 0)]
    t2d = pick_vocabulary(model, rows, args.draft_vocab, keep)
    n = tcfg["num_hidden_layers"]
    init_from_target(model, tstate, list(range(n - args.draft_layers, n)))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    args.out.mkdir(parents=True, exist_ok=True)
    step = 0
    if (args.out / "last.pt").is_file():
        ckpt = torch.load(args.out / "last.pt", weights_only=False)
        model.load_state_dict(ckpt["model"])
        step = ckpt["step"]
        opt.load_state_dict(ckpt["optimizer"])  # the draft vocabulary is picked again from today's rows (above)
        print(f"resumed at step {step}", flush=True)
    elif args.init is not None:
        print(f"initialised {init_from_drafter(model, args.init)} of {len(model.state_dict())} tensors from "
              f"{args.init}", flush=True)
    log = (args.out / "history.jsonl").open("a")
    if step == 0:
        start = {"step": 0, **acceptance(model.eval(), embed, held, args.block_size - 1)}
        log.write(json.dumps(start) + "\n")
        log.flush()
        print(start, flush=True)
    t0 = began = time.time()
    first_step = step
    while step < args.max_steps and time.time() - began < budget_s:
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * step / args.max_steps))
        loss, stats = train_step(model, opt, embed, rows, t2d, step, lr, args.batch_size, args.anchors, args.gamma,
                                 args.seed)
        step += 1
        if step % 20 == 0:
            print(f"step {step} loss {loss.item():.4f} {stats} lr {lr:.2e} {(time.time() - t0) / 20:.2f} s/step",
                  flush=True)
            t0 = time.time()
        out_of_time = time.time() - began >= budget_s
        if step % args.eval_every == 0 or step == args.max_steps or out_of_time:
            _save(model, opt, t2d, step, args)
            record = {"step": step, "loss": round(loss.item(), 4), **stats,
                      **acceptance(model.eval(), embed, held, args.block_size - 1)}
            log.write(json.dumps(record) + "\n")
            log.flush()
            print(record, flush=True)
            save_dflash(model, args.out / "export")
            if (args.data / "answers.jsonl").stat().st_size != data_size:  # the data job is still writing: take new rows
                data_size = (args.data / "answers.jsonl").stat().st_size
                rows = load_rows(args.data, layer_ids, stored)
                t2d = pick_vocabulary(model, rows, args.draft_vocab, keep)
                print(f"{len(rows)} training rows", flush=True)
    if args.ship is not None:
        record = {"date": time.strftime("%Y-%m-%d"), "data": f"{len(rows)} rows ({args.data.name})",
                  "steps": step - first_step, "total_steps": prior_steps(args.ship) + step - first_step,
                  "core_hours": round((time.time() - began) * args.threads / 3600, 2),
                  "command": args.record_command or "python -m celeris.train.dflash " + shlex.join(
                      argv if argv is not None else sys.argv[1:])}
        result = ship_if_better(model, args.ship, lambda m: acceptance(m, embed, held, args.block_size - 1), record)
        print({k: v for k, v in result.items() if k != "trained"}, flush=True)


if __name__ == "__main__":
    main()
