"""A prepared GPU step of the default drafter's training (``python -m celeris.train.gpu_drafter``; issue 49).

On one lent GPU, within about 10 minutes end to end, it runs the whole loop that takes days on a CPU:

1. **answers**: the target answers the committed training prompts (``train-data/dflash-smollm2.jsonl``'s
   messages) in Celeris's engine on the device at a large batch, with the default's own settings (its chat
   template, greedy, ``frequency_penalty`` 0.2: data decoded as the default decodes), and the held-out prompts too;
2. **features**: one pass of the target over each answered row gives its hidden states at the drafter's
   ``target_layer_ids`` (``TransformerLM.layout_hidden_states(capture=...)``, what the engine's verified path feeds
   the drafter), written as ``scripts/drafter_data.py``'s shards (``ids_j``, ``feat_j``, ``answers.jsonl``);
3. **training**: from the shipped drafter (``--init``) with ``celeris.train.dflash``'s objective and step
   (``train_step``), on the device, for ``--train-budget``;
4. **evaluation on the CPU's terms**: held-out tokens per target pass (``acceptance``, 7 drafts) of the shipped and
   the trained drafter on the same held-out rows, on the CPU in float32;
5. **output**: the trained drafter (``OUT/drafter``, bfloat16) and ``OUT/report.json`` (what it did: rows, tokens,
   seconds per stage, steps, both acceptances, the device); with ``--ship FOLDER`` the folder is replaced only if
   the trained drafter accepts more (``celeris.train.ship.ship_if_better``).

The slow test tier runs it on the CPU at a tiny size (``tests/train/test_gpu_drafter.py``), so that it works the
first time a device is lent; it is never part of CI's own runs on a GPU (there are none).

    python -m celeris.train.gpu_drafter --out runs/gpu-step --ship celeris/checkpoints/smollm2-135m-instruct-dflash
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from celeris.models.dflash import DFlashDraftModel, load_dflash, save_dflash
from celeris.train.dflash import Row, acceptance, load_rows, target_to_draft, train_step
from celeris.train.ship import parse_duration, prior_steps, ship_if_better

REPO = Path(__file__).resolve().parents[2]
DEFAULTS = {"prompts": REPO / "train-data" / "dflash-smollm2.jsonl",
            "heldout": REPO / "train-data" / "dflash-smollm2-heldout.jsonl",
            "init": REPO / "celeris" / "checkpoints" / "smollm2-135m-instruct-dflash"}


def read_prompts(path: Path, limit: int = 0) -> list[dict]:
    """Rows ``{"id", "source", "messages"}`` of a JSON-lines file (single-turn ones), the first ``limit`` (0: all).

    Raises:
        ValueError: the file does not exist or holds no such row.
    """
    if not path.is_file():
        raise ValueError(f"{path}: no such prompt file")
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    rows = [{"id": r["id"], "source": r.get("source", ""), "messages": r["messages"]} for r in rows
            if len(r.get("messages", [])) == 1]
    if not rows:
        raise ValueError(f"{path}: no single-turn rows with 'messages'")
    return rows[: limit or None]


def answer(llm, prompts: list[dict], batch_size: int, max_tokens: int) -> list[dict]:  # noqa: ANN001 - celeris.LLM
    """The target's answers with the model's default settings, ``batch_size`` prompts a ``generate`` call:
    ``prompts`` rows with ``prompt_len`` and ``ids`` (prompt + answer, the end id kept where the answer ended)."""
    params = llm.default_params(max_tokens=max_tokens)
    end, out = llm.tokenizer.eos_token_id, []
    for b in range(0, len(prompts), batch_size):
        batch = prompts[b:b + batch_size]
        ids = [llm.tokenizer.encode_chat(p["messages"]) for p in batch]
        for p, prompt, o in zip(batch, ids, llm.generate(ids, params), strict=True):
            ended = o.finish_reason == "stop"
            out.append(p | {"answer": o.text, "prompt_len": len(prompt), "ended": ended,
                            "ids": prompt + o.token_ids + ([end] if ended else [])})
    return out


@torch.no_grad()
def write_features(model: torch.nn.Module, rows: list[dict], layer_ids: list[int], folder: Path) -> None:
    """Shards of ``scripts/drafter_data.py``'s layout in ``folder``: per row ``ids_j`` (int32) and ``feat_j``
    (len(ids) - 1, len(layer_ids) * d) float16, the target's decoder-layer outputs at ``layer_ids`` from one causal
    pass over the row; ``answers.jsonl`` names them (64 rows a shard)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    device = next(model.parameters()).device
    lines = []
    for s in range(0, len(rows), 64):
        tensors = {}
        for j, r in enumerate(rows[s:s + 64]):
            ids = torch.tensor(r["ids"], device=device)[None]
            capture: dict[int, torch.Tensor | None] = dict.fromkeys(layer_ids)
            model.layout_hidden_states(ids, torch.arange(ids.shape[1], device=device)[None], None, capture=capture)
            feats = torch.cat([capture[i][0, :-1] for i in layer_ids], dim=-1)  # (L - 1, n * d)
            tensors[f"ids_{j}"] = torch.tensor(r["ids"], dtype=torch.int32)
            tensors[f"feat_{j}"] = feats.to(torch.float16).cpu().contiguous()
            lines.append({k: r[k] for k in ("id", "source", "prompt_len")} | {
                "shard": f"shard-{s:06d}.safetensors", "row": j, "layer_ids": layer_ids})
        save_file(tensors, folder / f"shard-{s:06d}.safetensors")
    (folder / "answers.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def train(model: DFlashDraftModel, embed: torch.Tensor, rows: list[Row], budget_s: float, max_steps: int,
          lr: float, batch_size: int, anchors: int, gamma: float = 4.0, warmup: int = 50) -> dict:
    """Train ``model`` (on ``embed``'s device) for ``budget_s`` seconds or ``max_steps`` steps, the learning rate
    warmed up over ``warmup`` steps and decayed on a cosine over the budget's time; returns ``{"steps",
    "seconds", "loss"}``."""
    pruned = model.d2t.numel() != embed.shape[0]  # a pruned draft vocabulary: target id -> draft row
    t2d = target_to_draft(model.d2t.to(embed.device), embed.shape[0]) if pruned else None
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    began, step, loss = time.time(), 0, torch.tensor(float("nan"))
    while step < max_steps and (elapsed := time.time() - began) < budget_s:
        rate = lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * elapsed / budget_s))
        loss, _ = train_step(model, opt, embed, rows, t2d, step, rate, batch_size, anchors, gamma, seed=0)
        step += 1
    return {"steps": step, "seconds": round(time.time() - began, 1), "loss": round(loss.item(), 4)}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="smollm2-135m-instruct-dflash", help="the default (a drafter folder's "
                    "pairing: its target answers) or a target checkpoint")
    ap.add_argument("--init", type=Path, default=DEFAULTS["init"], help="the drafter to start from")
    ap.add_argument("--prompts", type=Path, default=DEFAULTS["prompts"])
    ap.add_argument("--heldout", type=Path, default=DEFAULTS["heldout"])
    ap.add_argument("--rows", type=int, default=0, help="training prompts answered (0: every one)")
    ap.add_argument("--heldout-rows", type=int, default=24)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch-size", type=int, default=128, help="prompts a generate call")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--train-budget", default="5m")
    ap.add_argument("--max-steps", type=int, default=10**9)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--train-batch", type=int, default=32, help="rows a training step")
    ap.add_argument("--anchors", type=int, default=32)
    ap.add_argument("--ship", type=Path, help="replace this drafter folder when the trained one accepts more")
    return ap


def main(argv: list[str] | None = None) -> dict:
    """Run the step (module docstring); returns the report it writes to ``OUT/report.json``."""
    args = build_parser().parse_args(argv)
    from celeris.llm import LLM

    budget_s, stages, t = parse_duration(args.train_budget), {}, time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    llm = LLM(args.model, device=args.device, max_num_seqs=args.batch_size)
    init = load_dflash(args.init)
    layer_ids = list(init.config.target_layer_ids)
    train_rows = answer(llm, read_prompts(args.prompts, args.rows), args.batch_size, args.max_tokens)
    held_rows = answer(llm, read_prompts(args.heldout, args.heldout_rows), args.batch_size, args.max_tokens)
    stages["answers_s"] = round(time.time() - t, 1)
    t = time.time()
    for name, rows in (("data", train_rows), ("heldout", held_rows)):
        write_features(llm.model, rows, layer_ids, args.out / name)
        (args.out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))  # the text, kept
    stages["features_s"] = round(time.time() - t, 1)
    embed = llm.model.embed_tokens.weight.detach().float()  # (V, d): the tied head scores the drafts
    model = load_dflash(args.init, device=args.device)
    trained = train(model, embed.to(args.device), load_rows(args.out / "data", layer_ids, layer_ids), budget_s,
                    args.max_steps, args.lr, args.train_batch, args.anchors)
    t = time.time()
    held = load_rows(args.out / "heldout", layer_ids, layer_ids)
    model = model.float().cpu().eval()
    evaluate = lambda m: acceptance(m, embed.cpu(), held, init.config.block_size - 1)  # noqa: E731
    before, after = evaluate(init.eval()), evaluate(model)
    stages["evaluate_s"] = round(time.time() - t, 1)
    save_dflash(model, args.out / "drafter")
    report = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
              "rows": len(train_rows), "heldout_rows": len(held_rows),
              "answer_tokens": sum(len(r["ids"]) - r["prompt_len"] for r in train_rows), **stages, **trained,
              "heldout_tau_before": before["tau"], "heldout_tau_after": after["tau"],
              "per_position_after": after["per_position"]}
    if args.ship is not None:
        record = {"date": time.strftime("%Y-%m-%d"), "data": f"{len(train_rows)} rows (GPU step, penalized)",
                  "steps": trained["steps"], "total_steps": prior_steps(args.ship) + trained["steps"],
                  "core_hours": f"{trained['seconds'] / 60:.1f} GPU minutes ({report['device']})",
                  "command": "python -m celeris.train.gpu_drafter " + " ".join(argv or [])}
        shipped = ship_if_better(model, args.ship, evaluate, record)
        report["replaced"] = shipped["replaced"]
    (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report), flush=True)
    return report


if __name__ == "__main__":
    main()
