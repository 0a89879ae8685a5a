"""`celeris train`: the training loop (single process or DDP under torchrun).

AdamW with linear warm-up and cosine decay, gradient clipping, periodic
checkpoints with exact resume (model, optimiser, step; batches are a pure
function of (seed, step, rank), so a resumed run sees the same data), held-out
loss every ``eval_every`` steps, a tqdm progress bar with tokens/s and loss,
and export to a checkpoint folder at the end.

Under ``torchrun`` (``WORLD_SIZE`` > 1) it wraps the model in
DistributedDataParallel with gloo on CPU and NCCL on CUDA; each rank draws its
own batches and gradients are averaged.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from celeris.models.celeris import CelerisConfig, CelerisModel, count_parameters
from celeris.models.loader import load_model, save_checkpoint
from celeris.sampling.params import causal_defaults
from celeris.tokenizer import write_tokenizer_config
from celeris.train.data import load_tokens
from celeris.train.gate import function_prompts, parse_rate
from celeris.train.objective import OBJECTIVES

# Written to generation_config.json when the caller gives none: LLaDA's reference
# sampler (one token per denoising step, blocks of 32, greedy, low-confidence remasking).
DEFAULT_GENERATION = {"max_tokens": 128, "steps": 128, "block_length": 32, "temperature": 0.0,
                      "top_p": 1.0, "remasking": "low_confidence", "cfg_scale": 0.0}
# The autoregressive twin: the same defaults as LLM applies to any causal model (one token per step).
AR_GENERATION = causal_defaults(DEFAULT_GENERATION)
# A hybrid model: verified decoding, drafts from prompt lookup where the context repeats, else its mask slots.
HYBRID_GENERATION = {**AR_GENERATION, "decoding": "verified", "draft_source": "lookup_first"}


@dataclass(slots=True)
class TrainConfig:
    """Settings of one training run; saved beside its checkpoints as ``train_config.json``."""

    data_dir: str
    out_dir: str
    export_dir: str | None = None
    objective: str = "diffusion"
    prefix_prob: float = 0.0
    init: str | None = None  # hybrid: the causal checkpoint (name or folder) every weight starts from
    block_size: int = 4  # hybrid: noisy (drafting) block length, tokens
    full_mask_prob: float = 0.5  # hybrid: share of noisy blocks masked entirely
    # hybrid: a uint16 file of fixed-length sequences, the model's own greedy continuations
    # (scripts/self_distill_data.py); every other step trains on them with the masked loss only
    distill_data: str | None = None
    distill_len: int = 192
    # hybrid, distillation steps: weight and temperature of dParallel's certainty-forcing entropy term
    certainty_weight: float = 0.0
    certainty_temperature: float = 1.0
    # checkpoint gate: held-out function prompts scored at every save (celeris.train.gate); the export takes the
    # best-scoring checkpoint (ties go to the later one); 0 turns the gate off
    gate_prompts: int = 0
    gate_tokens: int = 128
    model: dict = field(default_factory=dict)
    seq_len: int = 512
    batch_size: int = 8
    max_steps: int = 1000
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 200
    eval_batches: int = 16
    save_every: int = 100
    seed: int = 0
    threads: int | None = None

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {sorted(OBJECTIVES)}, got '{self.objective}'")
        for name in ("seq_len", "batch_size", "max_steps", "eval_every", "save_every", "eval_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.prefix_prob <= 1:
            raise ValueError(f"prefix_prob must be in [0, 1], got {self.prefix_prob}")
        if self.prefix_prob and self.objective != "diffusion":
            raise ValueError("prefix_prob applies to the diffusion objective only")
        if self.init and self.objective not in ("hybrid", "ar"):
            raise ValueError(f"init applies to the hybrid and ar objectives, not '{self.objective}'")
        if self.objective == "hybrid" and not self.init:
            raise ValueError("the hybrid objective starts from a causal checkpoint: give init (e.g. celeris-code-6m-ar)")
        if self.distill_data and self.objective != "hybrid":
            raise ValueError("distill_data applies to the hybrid objective only")
        if self.certainty_weight and not self.distill_data:
            raise ValueError("certainty_weight applies to self-distillation steps: give distill_data")
        if self.certainty_weight < 0 or not self.certainty_temperature > 0:
            raise ValueError(f"certainty_weight must be >= 0 and certainty_temperature > 0, got "
                             f"{self.certainty_weight}, {self.certainty_temperature}")
        if self.gate_prompts < 0 or self.gate_tokens < 1:
            raise ValueError(f"gate_prompts must be >= 0 and gate_tokens >= 1, got {self.gate_prompts}, "
                             f"{self.gate_tokens}")
        if self.gate_prompts and self.objective == "diffusion":
            raise ValueError("the parse-rate gate decodes next-token: it needs the ar or hybrid objective")
        if self.block_size < 1 or not 0 <= self.full_mask_prob <= 1:
            raise ValueError(f"block_size must be >= 1 and full_mask_prob in [0, 1], got {self.block_size}, "
                             f"{self.full_mask_prob}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")


def best_gate(history: list[dict]) -> float:
    """The best held-out parse rate in ``history`` so far (-1.0 before the first gate)."""
    return max((h["gate_parse_rate"] for h in history if "gate_parse_rate" in h), default=-1.0)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``lr`` over ``warmup_steps``, then cosine decay to ``lr * min_lr_ratio``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def get_batch(tokens: np.ndarray, batch_size: int, seq_len: int, seed: int) -> torch.Tensor:
    """Random windows of ``seq_len`` tokens: (batch_size, seq_len) int64, a pure function of ``seed``."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(tokens) - seq_len, size=batch_size)
    return torch.from_numpy(np.stack([tokens[s : s + seq_len].astype(np.int64) for s in starts]))


def objective_kwargs(cfg: TrainConfig) -> dict:
    """The objective's own settings from the run config."""
    if cfg.objective == "hybrid":
        return {"block_size": cfg.block_size, "full_mask_prob": cfg.full_mask_prob}
    return {"prefix_prob": cfg.prefix_prob} if cfg.prefix_prob else {}


@torch.no_grad()
def evaluate(model: CelerisModel, tokens: np.ndarray, cfg: TrainConfig, device: torch.device) -> dict[str, float]:
    """Held-out loss (nats/token) on ``eval_batches`` fixed batches with fixed noise draws.

    Returns ``{"val_loss": ...}``; the hybrid objective adds its two terms, ``val_ntp`` (the next-token
    NLL, comparable with the twin's) and ``val_masked`` (drafting cross-entropy).
    """
    loss_fn = OBJECTIVES[cfg.objective]
    extra = {k: v for k, v in objective_kwargs(cfg).items() if k != "prefix_prob"}
    hybrid = cfg.objective == "hybrid"
    was_training = model.training
    model.eval()
    sums: dict[str, float] = {}
    for i in range(cfg.eval_batches):
        batch = get_batch(tokens, cfg.batch_size, cfg.seq_len, seed=10_000_000 + i).to(device)
        gen = torch.Generator().manual_seed(20_000_000 + i)
        out = loss_fn(model, batch, gen, **extra, **({"return_parts": True} if hybrid else {}))
        parts = {"val_loss": float(out[0]), **({f"val_{k}": v for k, v in out[2].items()} if hybrid else {})}
        for k, v in parts.items():
            sums[k] = sums.get(k, 0.0) + v
    model.train(was_training)
    return {k: v / cfg.eval_batches for k, v in sums.items()}


def _dist_setup() -> tuple[int, int, torch.device]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank = dist.get_rank()
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return rank, world, torch.device("cuda", local)
    return rank, world, torch.device("cpu")


def _atomic_torch_save(obj: dict, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _special_ids(data: Path, objective: str) -> tuple[object, dict]:
    """The data folder's tokenizer and the model config's special ids (vocabulary size, EOS, mask, pad)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(data / "tokenizer.json"))
    return tok, {
        "vocab_size": tok.get_vocab_size(),
        "eos_token_id": tok.token_to_id("<|endoftext|>"),
        "mask_token_id": tok.token_to_id("<|mask|>"),
        "pad_token_id": tok.token_to_id("<|pad|>"),
        "is_causal": objective == "ar",
    }


def _model_and_optimizer(cfg: TrainConfig, special: dict, device: torch.device
                         ) -> tuple[CelerisModel, torch.optim.AdamW]:
    """A fresh (or ``cfg.init``-initialised) model on ``device`` in train mode and its AdamW (no decay on 1-d
    parameters, betas 0.9 / 0.95)."""
    if cfg.init:
        model = init_from_checkpoint(cfg, special)
    else:
        model = CelerisModel(CelerisConfig(**{**cfg.model, **special, "max_position_embeddings": cfg.seq_len}))
        model.init_weights()
    model.to(device).train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optim = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    return model, optim


def _step_batch(cfg: TrainConfig, seed: int, train_tokens: np.ndarray, distill: np.ndarray | None,
                step: int, device: torch.device) -> tuple[torch.Tensor, dict]:
    """(batch (B, L) int64, the objective's keyword arguments) for one step: odd steps draw self-distillation rows
    (drafting targets only, dParallel / d3LLM) when ``distill`` is given, other steps the training text."""
    kwargs = objective_kwargs(cfg)
    if distill is not None and step % 2 == 1:
        rows = np.random.default_rng(seed).integers(0, len(distill), size=cfg.batch_size)
        kwargs.update(ntp_weight=0.0, certainty_weight=cfg.certainty_weight,
                      certainty_temperature=cfg.certainty_temperature)
        return torch.from_numpy(distill[rows].astype(np.int64)).to(device), kwargs
    return get_batch(train_tokens, cfg.batch_size, cfg.seq_len, seed).to(device), kwargs


def _resume(path: Path, model: CelerisModel, optim: torch.optim.Optimizer, device: torch.device
            ) -> tuple[int, int, float, list[dict]]:
    """(step, tokens seen, wall seconds, history) of ``path`` (``last.pt``) loaded into model and optimizer, or
    the start of a run when it does not exist."""
    if not path.exists():
        return 0, 0, 0.0, []
    state = torch.load(path, map_location=device, weights_only=False)
    model.load_state_dict(state["model"])
    optim.load_state_dict(state["optim"])
    return state["step"], state["tokens_seen"], state["wall"], state["history"]


def _save_best(model: CelerisModel, step: int, rate: float, out: Path) -> None:
    _atomic_torch_save({"model": model.state_dict(), "step": step, "gate_parse_rate": rate}, out / "best.pt")


def _finish(cfg: TrainConfig, model: CelerisModel, history: list[dict], counts: dict, gated: bool,
            rank: int, device: torch.device, default_generation: dict | None) -> dict:
    """The run's summary; with a parse-rate gate the best-gated weights are loaded (they are the export); rank 0
    writes ``history.json``, ``summary.json`` and the checkpoint folder ``cfg.export_dir``."""
    out, data = Path(cfg.out_dir), Path(cfg.data_dir)
    val = [h["val_loss"] for h in history if "val_loss" in h]
    summary = {**counts, "final_val_loss": val[-1] if val else None, "parameters": count_parameters(model)}
    if gated:
        best = torch.load(out / "best.pt", map_location=device, weights_only=False)
        model.load_state_dict(best["model"])
        summary.update(exported_step=best["step"], gate_parse_rate=best["gate_parse_rate"])
    if rank != 0:
        return summary
    (out / "history.json").write_text(json.dumps(history) + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if cfg.export_dir:
        write_tokenizer_config(data)
        generation = DEFAULT_GENERATION if not model.config.is_causal else (
            HYBRID_GENERATION if model.config.draft_block_size else AR_GENERATION)
        save_checkpoint(model, cfg.export_dir, data, default_generation or generation)
        shutil.copy(out / "train_config.json", Path(cfg.export_dir) / "training_args.json")
        print(f"exported checkpoint to {cfg.export_dir}", flush=True)
    return summary


def train(cfg: TrainConfig, default_generation: dict | None = None) -> dict:
    """Run (or resume) training; returns a summary dict (steps, tokens, losses, seconds).

    Resumes from ``out_dir/last.pt`` when it exists. Exports a checkpoint folder
    to ``export_dir`` at the end (rank 0 only).
    """
    if cfg.objective == "hybrid" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # its two-stream layout calls the layers directly, outside DDP's forward hooks (no gradient sync)
        raise ValueError("the hybrid objective runs in one process; use `celeris train` without torchrun")
    rank, world, device = _dist_setup()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out_dir)
    data = Path(cfg.data_dir)
    train_tokens, val_tokens = load_tokens(data / "train.bin"), load_tokens(data / "val.bin")
    tok, special = _special_ids(data, cfg.objective)
    torch.manual_seed(cfg.seed)
    model, optim = _model_and_optimizer(cfg, special, device)
    ckpt_path = out / "last.pt"
    step, tokens_seen, wall, history = _resume(ckpt_path, model, optim, device)
    ddp_model = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "train_config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")
        print(f"model: {count_parameters(model):,} parameters, objective {cfg.objective}, world {world}, "
              f"device {device}, resuming at step {step}", flush=True)
    loss_fn = OBJECTIVES[cfg.objective]
    distill = np.fromfile(cfg.distill_data, dtype=np.uint16).reshape(-1, cfg.distill_len) if cfg.distill_data else None
    gate_prompts = function_prompts(val_tokens, tok, cfg.gate_prompts) if cfg.gate_prompts and rank == 0 else []
    if gate_prompts and not any("gate_parse_rate" in h for h in history):  # the starting point is a candidate too
        history.append({"step": step, "gate_parse_rate": parse_rate(model, tok, gate_prompts, cfg.gate_tokens)})
        _save_best(model, step, history[-1]["gate_parse_rate"], out)
        print(f"step {step}: held-out parse rate {history[-1]['gate_parse_rate']:.3f} before training", flush=True)
    bar = tqdm(total=cfg.max_steps, initial=step, disable=rank != 0, dynamic_ncols=True, mininterval=5)
    while step < cfg.max_steps:
        t0 = time.perf_counter()
        for group in optim.param_groups:
            group["lr"] = lr_at(step, cfg)
        seed = cfg.seed * 1_000_003 + step * world + rank
        runner = model if world == 1 else _DDPView(ddp_model, model)
        batch, kwargs = _step_batch(cfg, seed, train_tokens, distill, step, device)
        loss, _ = loss_fn(runner, batch, torch.Generator().manual_seed(seed), **kwargs)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optim.step()
        step += 1
        tokens_seen += batch.numel() * world
        dt = time.perf_counter() - t0
        wall += dt
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{batch.numel() * world / dt:,.0f}", lr=f"{lr_at(step, cfg):.2e}")
        record: dict = {"step": step, "loss": loss.item(), "tokens_seen": tokens_seen, "wall_s": round(wall, 1)}
        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            record.update(evaluate(model, val_tokens, cfg, device))
            if rank == 0:
                parts = ", ".join(f"{k} {v:.4f}" for k, v in record.items() if k.startswith("val_"))
                bar.write(f"step {step}: held-out {parts} nats/token")
        saving = rank == 0 and (step % cfg.save_every == 0 or step == cfg.max_steps)
        if saving and gate_prompts:
            record["gate_parse_rate"] = parse_rate(model, tok, gate_prompts, cfg.gate_tokens)
            bar.write(f"step {step}: held-out parse rate {record['gate_parse_rate']:.3f} ({len(gate_prompts)} prompts)")
            if record["gate_parse_rate"] >= best_gate(history):
                _save_best(model, step, record["gate_parse_rate"], out)
        history.append(record)
        if saving:
            _atomic_torch_save(
                {"model": model.state_dict(), "optim": optim.state_dict(), "step": step,
                 "tokens_seen": tokens_seen, "wall": wall, "history": history},
                ckpt_path,
            )
    bar.close()
    counts = {"steps": step, "tokens_seen": tokens_seen, "wall_s": round(wall, 1)}
    summary = _finish(cfg, model, history, counts, bool(gate_prompts), rank, device, default_generation)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return summary


def init_from_checkpoint(cfg: TrainConfig, special: dict) -> CelerisModel:
    """Every weight of the causal checkpoint ``cfg.init`` (hybrid adaptation, Fast-dLLM v2 arXiv:2509.26328).

    The mask token's embedding row, never trained in an autoregressive model, starts at the mean embedding
    (the embedding is tied to the output head, so its logit starts at the mean logit). The config gains
    ``draft_block_size`` (the noisy block length the model learns to draft).

    Raises:
        ValueError: the checkpoint is not a causal Celeris model, or its tokenizer differs from the corpus's.
    """
    from celeris.llm import resolve_model

    model = load_model(resolve_model(cfg.init), dtype=torch.float32)
    if not model.config.is_causal:
        raise ValueError(f"--init {cfg.init} is not a causal model (is_causal=false)")
    for key, value in special.items():
        if key != "is_causal" and getattr(model.config, key) != value:
            raise ValueError(f"--init {cfg.init}: {key} {getattr(model.config, key)} differs from the corpus's {value}")
    if cfg.objective == "hybrid":
        if not model.config.draft_block_size:  # a twin: its mask row was never trained (a hybrid's was)
            with torch.no_grad():
                emb = model.embed_tokens.weight
                emb[model.config.mask_token_id] = emb.mean(dim=0)
        model.config.draft_block_size = cfg.block_size
    return model


def load_run(run_dir: str | Path) -> tuple[CelerisModel, int]:
    """A hybrid (or any --init) run's ``last.pt`` on the architecture of the checkpoint its
    ``train_config.json`` started from, with that run's ``draft_block_size``: (eval-mode model, step).

    Raises:
        FileNotFoundError: the folder has no ``train_config.json`` or ``last.pt``.
        ValueError: the run did not start from a checkpoint (no ``init``).
    """
    from celeris.llm import resolve_model

    run = Path(run_dir)
    cfg = json.loads((run / "train_config.json").read_text())
    if not cfg.get("init"):
        raise ValueError(f"{run} did not start from a checkpoint (no init in train_config.json)")
    model = load_model(resolve_model(cfg["init"]))
    state = torch.load(run / "last.pt", map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"])
    if cfg.get("objective") == "hybrid":
        model.config.draft_block_size = cfg.get("block_size", 4)
    return model.eval(), state["step"]


class _DDPView:
    """Lets the objective call ``hidden_states``/``logits`` while gradients sync through DDP.

    DDP only hooks ``forward``; the objectives call the model's sub-functions, so
    we route them through DDP's forward with a small dispatch.
    """

    def __init__(self, ddp: torch.nn.parallel.DistributedDataParallel, model: CelerisModel) -> None:
        self.ddp, self.model, self.config = ddp, model, model.config

    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.ddp(input_ids, return_hidden=True)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden)
