"""A DFlash drafter as a proposer of verified decoding: block-diffusion drafts from the target's hidden states.

The drafter (``celeris.models.dflash``) is a second, small model beside the target. Each target pass of verified
decoding also returns the target's hidden states at the drafter's ``target_layer_ids`` for the columns it computed
(``layout_hidden_states(capture=...)``); the features of the columns the pass accepted are queued for the row, and
the next drafter call takes them into the row's KV cache of context features (so the cache lags one pass, as in
z-lab/dflash ``dflash_generate``); under the engine that cache is the row's drafter layers of the engine's KV store
(``celeris.engine.kv.KVStore``). A drafter call embeds the block ``[last accepted token, mask x (block_size - 1)]``
with the target's embedding table, runs the drafter once (non-causal inside the block), crops the block's own
keys/values from the cache, and scores block positions 1..k with the target's LM head; the drafts are the argmax
at every temperature (a one-hot draft distribution, so speculative sampling keeps the target's distribution).

``speculative_config`` is vLLM's spelling: ``{"method": "dflash", "model": PATH, "num_speculative_tokens": k}``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from celeris.config import QUANTIZATION_METHODS
from celeris.models import blocks, fast_ops
from celeris.models.dflash import DFlashDraftModel, DFlashMLP, DraftKVCache, load_dflash
from celeris.models.quantize import (
    QuantizationError,
    QuantizedLinear,
    activation_dtype,
    parse_method,
    quantization_of,
    quantize_head_rows,
    quantize_model,
)
from celeris.sampling.select import NEG_INF

METHODS = ("dflash",)
BLOCK_METHOD = "q8_0"  # the drafter's linears and draft head in GGUF Q8_0 blocks on the block kernel (CPU)


@dataclass(frozen=True)
class SpeculativeConfig:
    """What ``--speculative-config`` / ``LLM(speculative_config=...)`` name: the method, the drafter folder, the
    drafts per pass (None: the drafter's ``block_size - 1``) and ``disable_by_batch_size`` (vLLM's key: with at
    least this many requests running, passes of the default draft source ``lookup_first`` skip the drafter and
    verify prompt-lookup drafts only; None: never; an explicit ``draft_source`` ``dflash`` always drafts) and
    ``lookup_disable_by_batch_size`` (a Celeris key: with at least this many requests running, ``lookup_first``
    passes skip prompt lookup too and decode next-token; None: never; ``draft_source`` ``lookup`` always looks up)
    and ``quantization`` (vLLM's key, here the weight-only method the drafter's float weights are quantized with at
    load: its linear layers and its draft head, whatever the target's width; ``q8_0`` (a Celeris name, CPU only):
    GGUF's Q8_0 blocks on the block kernel of ``celeris.models.blocks``, with the fast pass's operators; None: the
    target's ``--quantization``: q8_0 under gguf or q8_0 on a CPU). A quantized drafter changes the drafts, never the
    answer: the target verifies every draft.
    ``draft_confidence_threshold`` (a Celeris key, after transformers' ``assistant_confidence_threshold``): a pass
    verifies the drafter's leading drafts whose probability under the drafter is at least this (0 to
    ``num_speculative_tokens`` of them), so an unsure drafter costs a narrower target pass; None: all k.
    ``draft_min_gain`` (a Celeris key): ``lookup_first`` passes skip the drafter for a row while the row's running
    mean of drafter tokens accepted per drafter call is below this, probing it again every ``PROBE_EVERY`` passes
    (``DFlashProposer.worth_calling``); a call costs a drafter pass and a wider target pass, so a drafter that is
    rarely accepted on a request slows it down; None: every lookup miss calls the drafter.
    """

    method: str
    model: str
    num_speculative_tokens: int | None = None
    disable_by_batch_size: int | None = None
    lookup_disable_by_batch_size: int | None = None
    quantization: str | None = None
    draft_confidence_threshold: float | None = None
    draft_min_gain: float | None = None

    @classmethod
    def parse(cls, raw: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From a JSON string, a dict or a SpeculativeConfig; None stays None.

        Raises:
            ValueError: not JSON or not an object, an unknown key or method, no ``model``, a bad
                ``num_speculative_tokens``.
        """
        if raw is None or isinstance(raw, SpeculativeConfig):
            return raw
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not JSON: {exc.msg}") from None
        if not isinstance(raw, dict):
            raise ValueError("speculative_config must be a JSON object such as "
                             '{"method": "dflash", "model": "PATH", "num_speculative_tokens": 7}')
        unknown = sorted(set(raw) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)} (known: "
                             f"{', '.join(cls.__dataclass_fields__)})")
        method = raw.get("method", "dflash")
        if method not in METHODS:
            raise ValueError(f"speculative_config method '{method}' is not supported (supported: {', '.join(METHODS)}"
                             "; prompt lookup is draft_source 'lookup')")
        if not isinstance(raw.get("model"), str) or not raw["model"]:
            raise ValueError("speculative_config needs 'model': the drafter's folder")
        for key in ("num_speculative_tokens", "disable_by_batch_size", "lookup_disable_by_batch_size"):
            v = raw.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"speculative_config {key} must be a positive integer, got {v!r}")
        quantization = raw.get("quantization")
        # a drafter folder holds float weights; "none" keeps them (not the target's method, which None follows)
        drafter_methods = [m for m in QUANTIZATION_METHODS if m != "gguf"]
        if quantization is not None and quantization not in drafter_methods:
            raise ValueError(f"speculative_config quantization {quantization!r} is not one for a drafter's float "
                             f"weights ({', '.join(drafter_methods)})")
        threshold = raw.get("draft_confidence_threshold")
        if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, int | float)
                                      or not 0 < threshold < 1):
            raise ValueError(f"speculative_config draft_confidence_threshold must be a probability in (0, 1), got "
                             f"{threshold!r}")
        gain = raw.get("draft_min_gain")
        if gain is not None and (isinstance(gain, bool) or not isinstance(gain, int | float) or not 0 <= gain < 64):
            raise ValueError(f"speculative_config draft_min_gain must be a number of tokens in [0, 64), got {gain!r}")
        return cls(method, raw["model"], raw.get("num_speculative_tokens"), raw.get("disable_by_batch_size"),
                   raw.get("lookup_disable_by_batch_size"), quantization,
                   None if threshold is None else float(threshold), None if gain is None else float(gain))

    def to_json(self) -> str:
        """The JSON string ``parse`` reads back (what crosses process boundaries: Ray workers, the CLI)."""
        return json.dumps({k: getattr(self, k) for k in self.__dataclass_fields__})


def check_drafter(drafter: DFlashDraftModel, target: torch.nn.Module, drafter_name: str = "the drafter",
                  num_speculative_tokens: int | None = None) -> None:
    """Raise ValueError, naming both sides, when ``drafter`` cannot draft for ``target``.

    Checks: the target is causal with a KV cache; the hidden size and vocabulary agree; every ``target_layer_ids``
    entry is a target layer; ``mask_token_id`` is a target id (the block is embedded with the target's table); and
    ``num_speculative_tokens`` is 1 .. block_size - 1.
    """
    cfg, tcfg = drafter.config, target.config
    if not getattr(tcfg, "is_causal", False) or not getattr(target, "supports_kv_cache", False):
        raise ValueError(f"{drafter_name} drafts for an autoregressive target; this model is not causal")
    hidden, vocab, layers = target.arch.hidden_size, tcfg.vocab_size, len(target.layers)
    if cfg.hidden_size != hidden:
        raise ValueError(f"{drafter_name} has hidden size {cfg.hidden_size}, the target {hidden}")
    if cfg.vocab_size != vocab:
        raise ValueError(f"{drafter_name} has a vocabulary of {cfg.vocab_size}, the target {vocab}")
    if cfg.num_target_layers != layers or any(not 0 <= i < layers for i in cfg.target_layer_ids):
        raise ValueError(f"{drafter_name} reads target layers {cfg.target_layer_ids} of {cfg.num_target_layers}; "
                         f"the target has {layers} layers")
    if cfg.mask_token_id is None or not 0 <= cfg.mask_token_id < vocab:
        raise ValueError(f"{drafter_name}'s mask_token_id {cfg.mask_token_id} is not an id of the target's "
                         f"vocabulary of {vocab}")
    if num_speculative_tokens is not None:
        check_num_drafts(num_speculative_tokens, cfg.block_size, drafter_name)


def check_num_drafts(k: int, block_size: int, drafter_name: str = "the drafter") -> None:
    """Raise ValueError unless ``k`` drafts per pass fit a drafter block of ``block_size`` (1 .. block_size - 1:
    position 0 of the block is the last accepted token). The one check of ``num_speculative_tokens`` against a
    drafter, at load (``check_drafter``) and per request (``celeris.sampling.verified.check_draft_source``)."""
    if not 1 <= k <= block_size - 1:
        raise ValueError(f"num_speculative_tokens {k} is outside 1..{block_size - 1} ({drafter_name}'s "
                         f"block_size is {block_size})")


@dataclass
class DraftState:
    """One row's drafter state: its KV cache of context features (bound to the row's drafter layers of a KV store
    by ``celeris.engine.verified``, else grown on its own) and the features accepted since the last call (each
    (n, len(target_layer_ids) * d), in column order)."""

    cache: DraftKVCache = field(default_factory=DraftKVCache)
    queued: list[torch.Tensor] = field(default_factory=list)
    calls: int = 0
    gain: float = 1.0  # running mean of drafter tokens accepted per call (``draft_min_gain``), starting hopeful
    skipped: int = 0  # passes the row skipped the drafter since its last call
    from_drafter: bool = False  # the row's pending drafts came from the drafter (not prompt lookup)


PROBE_EVERY = 4  # with draft_min_gain: a row whose gain is low still calls the drafter every this many passes
# (the default of ``DFlashProposer.probe_every``)
GAIN_WEIGHT = 0.25  # weight of the newest call in a row's running gain (an exponential moving average)


class DFlashProposer:
    """Drafts for verified decoding from a DFlash drafter reading ``target``'s hidden states.

    Args:
        drafter: the loaded drafter (``load_dflash``), checked against ``target`` (``check_drafter``).
        target: the causal target; its embedding table embeds the block and its head scores the drafts.
        num_speculative_tokens: drafts per pass (default ``block_size - 1``).
        name: how errors name the drafter (its folder).
        disable_by_batch_size: with at least this many rows running, skip the drafter (None: never).
        lookup_disable_by_batch_size: with at least this many rows running, ``lookup_first`` skips prompt lookup too
            (None: never).
        draft_confidence_threshold: verify only the leading drafts the drafter gives at least this probability
            (``confident``; None: all of them).
        draft_min_gain: ``lookup_first`` skips the drafter for a row while its running gain is below this
            (``worth_calling``; None: never).
    """

    def __init__(self, drafter: DFlashDraftModel, target: torch.nn.Module, num_speculative_tokens: int | None = None,
                 name: str = "the drafter", disable_by_batch_size: int | None = None,
                 lookup_disable_by_batch_size: int | None = None,
                 draft_confidence_threshold: float | None = None, draft_min_gain: float | None = None) -> None:
        check_drafter(drafter, target, name, num_speculative_tokens)
        self.drafter, self.target, self.name = drafter, target, name
        self.block_size = drafter.config.block_size
        self.layer_ids = list(drafter.config.target_layer_ids)
        self.k = num_speculative_tokens or self.block_size - 1
        self.disable_by_batch_size = disable_by_batch_size
        self.lookup_disable_by_batch_size = lookup_disable_by_batch_size
        self.draft_confidence_threshold = draft_confidence_threshold
        self.draft_min_gain = draft_min_gain
        self.probe_every = PROBE_EVERY  # passes between a low-gain row's drafter calls (``worth_calling``)
        self.calls = 0  # drafter passes, all rows (a call drafts one row)
        self._draft_head: torch.Tensor | QuantizedLinear | None = None

    def enabled(self, running: int) -> bool:
        """Whether passes with ``running`` rows draft with the drafter (``disable_by_batch_size``)."""
        return self.disable_by_batch_size is None or running < self.disable_by_batch_size

    def lookup_enabled(self, running: int) -> bool:
        """Whether ``lookup_first`` passes with ``running`` rows try prompt lookup (``lookup_disable_by_batch_size``)."""
        return self.lookup_disable_by_batch_size is None or running < self.lookup_disable_by_batch_size

    def worth_calling(self, state: DraftState) -> bool:
        """Whether a ``lookup_first`` pass of the row with ``state`` calls the drafter (``draft_min_gain``): while
        the row's running gain (drafter tokens accepted per call, ``record``) is below it, the row decodes
        next-token and calls again only every ``probe_every`` passes, to notice when its text turns predictable.
        Like vLLM's ``disable_by_batch_size`` it changes the cost, never the answer: the target verifies."""
        if self.draft_min_gain is None or state.gain >= self.draft_min_gain or state.skipped + 1 >= self.probe_every:
            state.skipped = 0
            return True
        state.skipped += 1
        return False

    @staticmethod
    def record(state: DraftState, accepted: int) -> None:
        """Fold one drafter call's accepted drafts (0 when it drafted none it was sure of) into the row's gain."""
        state.gain += GAIN_WEIGHT * (accepted - state.gain)

    def confident(self, logits: torch.Tensor, drafts: list[int], columns: list[int] | None = None) -> list[int]:
        """The leading ``drafts`` whose probability under the drafter's ``logits`` (k, V) is at least
        ``draft_confidence_threshold`` (all of them without one): transformers' assisted generation stops its
        assistant the same way (``assistant_confidence_threshold``). The target still verifies what is kept.
        ``columns``: each draft's column of ``logits`` when they are not its id (scores over the pruned draft
        vocabulary: ``propose_draft_vocab``)."""
        if self.draft_confidence_threshold is None or not drafts:
            return drafts
        for j, column in enumerate(drafts if columns is None else columns):  # the first unsure draft ends the scan
            if not float(logits[j].float().softmax(-1)[column]) >= self.draft_confidence_threshold:  # NaN: unsure
                return drafts[:j]
        return drafts

    def capture(self) -> dict[int, torch.Tensor | None]:
        """The ``capture`` argument of a target pass: the layers whose outputs the drafter reads."""
        return dict.fromkeys(self.layer_ids)

    @staticmethod
    def features(captured: dict[int, torch.Tensor | None]) -> torch.Tensor:
        """(B, Lw, n * d) context features of a pass: the captured layer outputs concatenated in layer order."""
        return torch.cat([captured[i] for i in captured], dim=-1)

    def queue(self, state: DraftState, feats: torch.Tensor) -> None:
        """Queue the features (n, n_layers * d) of columns a pass accepted, in order."""
        state.queued.append(feats)

    @torch.no_grad()
    def draft_head(self) -> torch.Tensor | QuantizedLinear:
        """(V_draft, d) rows of the target's head for the drafter's pruned vocabulary (``d2t``), in the head's
        dtype, gathered once and kept: every call of ``propose_draft_vocab`` scores with them (gathering them per call, or
        dequantizing them from an int8 table per call, cost as much as the drafter's own layers). When the drafter
        is quantized (``quantization_of``), the rows are kept as that method's head (int8 per channel:
        ``head_method``) and score through its kernel: the float rows were a third of a float32 drafter call."""
        if self._draft_head is None:
            target, d2t = self.target, self.drafter.d2t
            head = target.embed_tokens if target.lm_head is None else target.lm_head
            # a quantized table (celeris.models.quantize.Int8Embedding) dequantizes the draft rows, never the whole table
            rows = (head.rows(d2t) if hasattr(head, "rows") else head.weight[d2t]).detach().clone()
            method = quantization_of(self.drafter)
            if method == BLOCK_METHOD:
                self._draft_head = blocks.BlockLinear(blocks.quantize_blocks(rows), "Q8_0", rows.shape[1])
            elif method is not None:
                self._draft_head = quantize_head_rows(rows, parse_method(method),
                                                      activation_dtype(rows.device, rows.dtype), "the drafter's head rows")
            else:
                self._draft_head = rows
        return self._draft_head

    @torch.no_grad()
    def propose_draft_vocab(self, state: DraftState, last_token: int, start: int,
                            k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft scores for the k tokens after ``last_token`` at column ``start``, where the drafter has them:
        (k, V_draft) float32 over its pruned vocabulary with the target id of each column (``d2t``, (V_draft,)
        int64, ascending), or (k, V) and None when it scores the whole vocabulary (``over_target_vocab`` puts the
        scores in place over V). The features of every column before ``start`` must be in the cache or queued.
        Penalties, the argmax and the confidence then read V_draft columns, not V (a sixth of SmolLM2's
        49,152 with the shipped 8,192).

        Raises:
            RuntimeError: the queued features do not cover the columns up to ``start`` (a bookkeeping bug).
        """
        target, cfg = self.target, self.drafter.config
        feats = torch.cat(state.queued) if state.queued else None
        state.queued.clear()
        have = state.cache.length + (0 if feats is None else feats.shape[0])
        if have != start:
            raise RuntimeError(f"drafter context covers {have} columns, the block starts at {start}")
        device = next(self.drafter.parameters()).device
        if feats is None:
            feats = torch.zeros((0, len(self.layer_ids) * cfg.hidden_size), device=device)
        block = torch.full((1, self.block_size), cfg.mask_token_id, dtype=torch.long, device=device)
        block[0, 0] = last_token
        positions = torch.arange(state.cache.length, start + self.block_size, device=device)[None]
        hidden = self.drafter(target.embed(block), feats[None], positions, state.cache)  # (1, bs, d)
        state.cache.crop(start)
        state.calls += 1
        self.calls += 1
        out = hidden[0, 1 : 1 + k].to(next(target.parameters()).dtype)  # (k, d)
        d2t = self.drafter.d2t
        if d2t.numel() == target.config.vocab_size:
            return target.logits(out), None  # (k, V)
        return self.drafter.draft_logits(out[None], self.draft_head())[0], d2t  # (k, V_draft)


def over_target_vocab(logits: torch.Tensor, ids: torch.Tensor | None, vocab: int) -> torch.Tensor:
    """Draft scores (k, V_draft) over a pruned draft vocabulary put at their target ids ``ids`` of a (k, ``vocab``)
    float32 tensor, -inf elsewhere; ``logits`` as they are when ``ids`` is None (already over the whole vocabulary)."""
    if ids is None:
        return logits
    return torch.full((logits.shape[0], vocab), NEG_INF, device=logits.device).index_copy_(1, ids, logits)


def load_proposer(config: SpeculativeConfig, target: torch.nn.Module) -> DFlashProposer:
    """Load ``config.model`` as a DFlash drafter on the target's device and dtype and check it.

    Raises:
        ValueError: the folder is not a DFlash drafter, or it does not fit the target (``check_drafter``).
    """
    p = next(target.parameters())
    folder = Path(config.model)
    if not folder.is_dir():
        raise ValueError(f"drafter folder '{folder}' does not exist")
    drafter = load_dflash(folder, device=p.device, dtype=p.dtype)
    return DFlashProposer(drafter, target, config.num_speculative_tokens, name=f"drafter '{folder.name}'",
                          disable_by_batch_size=config.disable_by_batch_size,
                          lookup_disable_by_batch_size=config.lookup_disable_by_batch_size,
                          draft_confidence_threshold=config.draft_confidence_threshold,
                          draft_min_gain=config.draft_min_gain)


def quantize_drafter(proposer: DFlashProposer, method: str) -> None:
    """Quantize the drafter's float weights in place with ``method``: a ``quantize_model`` method (its linear
    layers; the draft head follows in ``draft_head``), or ``BLOCK_METHOD``: every linear as GGUF Q8_0 blocks
    (``blocks.quantize_linears``, gguf-py's quantizer) on the block kernel and its norms on the fast pass's
    operators (``fast_ops.enable``), as a GGUF target's layers run. Measured (``scripts/pass_routes.py``'s machine,
    1 thread, the default on 6 MT-Bench prompts): a drafter call 3.4 ms against 6.8 ms under int8.

    Raises:
        QuantizationError: an unknown method, q8_0 off the CPU, or a layer the method cannot take.
    """
    drafter = proposer.drafter
    if method != BLOCK_METHOD:
        quantize_model(drafter, method)
        return
    if next(drafter.parameters()).device.type != "cpu":
        raise QuantizationError(f"quantization {BLOCK_METHOD!r} (the block kernel) runs on the CPU only")
    for module in drafter.modules():
        if isinstance(module, DFlashMLP):
            module.fuse()  # gate and up in one product
    try:
        blocks.quantize_linears(drafter, "Q8_0")
    except blocks.BlockError as exc:
        raise QuantizationError(str(exc)) from None
    fast_ops.enable(drafter)
    drafter.__dict__["_celeris_quantization"] = BLOCK_METHOD
    proposer._draft_head = None  # rebuilt as Q8_0 rows on the next call


def attach(target: torch.nn.Module, proposer: DFlashProposer | None) -> None:
    """Keep ``proposer`` beside ``target`` (not as a submodule: the target's parameters and state dict stay its
    own), where ``proposer_of`` finds it for every decoding path."""
    target.__dict__["_celeris_proposer"] = proposer


def proposer_of(target: torch.nn.Module) -> DFlashProposer | None:
    """The drafter ``attach`` put beside ``target``, or None."""
    return target.__dict__.get("_celeris_proposer")
