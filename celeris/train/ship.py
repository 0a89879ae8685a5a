"""Training in session-sized steps: a wall-clock budget, and a shipped drafter replaced only by one that accepts more.

A drafter's training runs for days on a CPU, and a machine does not survive between sessions, so each session
continues from the shipped drafter (``--init``), trains for ``--time-budget``, and ``ship_if_better`` then measures
both drafters' held-out tokens per target pass (``acceptance``) on the same rows: the trained one replaces the
shipped folder only when it beats it, and every step, replaced or not, is appended to the folder's
``training-steps.jsonl`` and its card's table (``README.md``, section ``STEPS_HEADING``), so the curve of every step
taken so far stays in the repository.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path

from celeris.models.dflash import DFlashDraftModel, load_dflash, save_dflash

MAX_SHIPPED_BYTES = 16 * 2**20  # the drafter's weights in the package: bfloat16, at most 16 MiB
STEPS_FILE = "training-steps.jsonl"
STEPS_HEADING = "## Training steps (one a session, `--time-budget`, `--ship`)"
UNITS = {"s": 1, "m": 60, "h": 3600}


def parse_duration(text: str) -> float:
    """Seconds in a duration such as ``90s``, ``30m``, ``2h`` or ``1.5h`` (a bare number: seconds).

    Raises:
        ValueError: anything else, or a duration that is not positive.
    """
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if found is None or float(found.group(1)) <= 0:
        raise ValueError(f"--time-budget {text!r}: give a positive duration such as 90s, 30m or 2h")
    return float(found.group(1)) * UNITS[found.group(2) or "s"]


def prior_steps(folder: Path) -> int:
    """Training steps behind the drafter in ``folder``: the ``total_steps`` of the last step its ``STEPS_FILE``
    records as replacing it (0 without one)."""
    path = folder / STEPS_FILE
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []
    return next((r["total_steps"] for r in reversed(lines) if r.get("replaced")), 0)


def check_drafter_folder(folder: Path) -> None:
    """Raise ValueError (one line naming the flag) unless ``folder`` holds a drafter (its ``config.json``)."""
    if not (folder / "config.json").is_file():
        raise ValueError(f"--ship {folder}: no drafter there (config.json)")


def weight_bytes(model: DFlashDraftModel) -> int:
    """Bytes of ``model``'s state in bfloat16: what ``save_dflash`` writes as ``model.safetensors`` (about)."""
    return sum(t.numel() * 2 for t in model.state_dict().values())


def ship_if_better(model: DFlashDraftModel, folder: Path, evaluate, record: dict) -> dict:  # noqa: ANN001
    """Replace the drafter in ``folder`` by ``model`` when ``model`` accepts more on the held-out rows.

    Args:
        model: the trained drafter.
        folder: the shipped drafter's folder (``config.json``, ``model.safetensors``, maybe ``draft_vocab.safetensors``).
        evaluate: drafter -> ``acceptance``'s dict on the held-out rows (both drafters meet the same rows).
        record: what this step was (data, steps, core-hours, the command), stored with the result.

    Returns:
        ``record`` with ``shipped_tau``, ``trained_tau``, ``trained`` (acceptance dict), ``replaced`` (bool) and,
        when not replaced, ``why``; appended to ``folder/STEPS_FILE`` and the card's table either way.

    Raises:
        ValueError: ``folder`` holds no drafter.
    """
    check_drafter_folder(folder)
    shipped = evaluate(load_dflash(folder).eval())
    trained = evaluate(model.eval())
    out = record | {"shipped_tau": shipped["tau"], "trained_tau": trained["tau"], "trained": trained}
    size = weight_bytes(model)
    if trained["tau"] <= shipped["tau"]:
        out |= {"replaced": False, "why": f"held-out tau {trained['tau']} <= the shipped drafter's {shipped['tau']}"}
    elif size > MAX_SHIPPED_BYTES:
        out |= {"replaced": False, "why": f"{size} bytes of weights, over {MAX_SHIPPED_BYTES}"}
    else:
        with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
            save_dflash(model, tmp)  # bfloat16; then each file moved over the shipped one
            for name in ("config.json", "model.safetensors", "draft_vocab.safetensors"):
                if (Path(tmp) / name).is_file():
                    shutil.move(str(Path(tmp) / name), folder / name)
                elif (folder / name).is_file():
                    (folder / name).unlink()
        out |= {"replaced": True}
    with (folder / STEPS_FILE).open("a") as f:
        f.write(json.dumps(out) + "\n")
    _card_row(folder / "README.md", out)
    return out


def _card_row(card: Path, step: dict) -> None:
    """Append one row for ``step`` to the card's ``STEPS_HEADING`` table (the section made at the end if absent)."""
    text = card.read_text() if card.is_file() else ""
    if STEPS_HEADING not in text:
        text = text.rstrip("\n") + ("\n\n" if text else "") + STEPS_HEADING + "\n\n" + (
            "| date | data | steps (total) | core-hours | held-out tokens per pass: shipped -> trained | replaced |\n"
            "|---|---|---|---|---|---|\n")
    row = (f"| {step.get('date', '')} | {step.get('data', '')} | {step.get('steps', '')} ({step.get('total_steps', '')})"
           f" | {step.get('core_hours', '')} | {step['shipped_tau']} -> {step['trained_tau']} | "
           f"{'yes' if step['replaced'] else 'no: ' + step.get('why', '')} |\n")
    card.write_text(text.rstrip("\n") + "\n" + row)  # the section stays the card's last

