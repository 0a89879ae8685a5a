"""The import map of ``celeris/``: no circle between modules, and every import runs down the floors.

Every ``import`` and ``from ... import`` in ``celeris/`` is read with ``ast``: at module level, inside functions
(lazy) and under ``if TYPE_CHECKING:``; a lazy import that would close a circle is the same design bug as a
top-level one, only hidden. Importing ``a.b.c`` also runs the package faces ``a/__init__.py`` and
``a/b/__init__.py``, so an import counts as one of each package it enters as well (but not of ``celeris`` itself,
which every module enters, nor of a package the importing module already sits in).

The floors, lowest first (``FLOORS``). A module may import from a lower floor, and from its own floor only inside
its own unit (a package, or the modules a unit names):

0. ground: ``config``; ``tokenizer`` with ``chat_template`` (the template renderer it uses); ``structured``
   (``grammar`` and ``finite``, the finite-value check of schemas); ``data`` (the shipped prompt sets and the
   HumanEval scoring rules in ``data/completions.py``); ``ray_session`` (starting or joining Ray, shared by
   ``serve/ray.py`` and ``batch/ray_runner.py``: it imports nothing of Celeris)
1. ``text``: stop strings, streamed text, the canvas view (it asks ``structured.grammar`` whether stop strings
   apply to a constrained answer, so it sits just above the rest of the ground)
2. ``models``
3. ``sampling`` with ``params``
4. ``reference`` and ``engine``
5. ``llm`` (and ``load``, its steps) with the package face ``celeris/__init__.py`` (``SamplingParams``, and
   ``LLM`` loaded lazily)
6. ``serve``
7. ``batch``, ``bench``, ``train``
8. ``cli``

A new module outside every unit fails the test until it is given a floor here.
"""

from __future__ import annotations

import ast
import functools
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from tests.fixtures.fresh_interpreter import fresh_interpreter

ROOT = Path(__file__).resolve().parents[1]

# (floor, unit, modules: a name covers the module and everything under it)
FLOORS: list[tuple[int, str, tuple[str, ...]]] = [
    (0, "config", ("celeris.config",)),
    (0, "tokenizer", ("celeris.tokenizer", "celeris.chat_template")),
    (0, "structured", ("celeris.structured",)),
    (0, "data", ("celeris.data",)),
    (0, "ray_session", ("celeris.ray_session",)),
    (1, "text", ("celeris.text",)),
    (2, "models", ("celeris.models",)),
    (3, "sampling", ("celeris.sampling", "celeris.params")),
    (4, "reference", ("celeris.reference",)),
    (4, "engine", ("celeris.engine",)),
    (5, "llm", ("celeris.llm", "celeris.load")),
    (7, "bench", ("celeris.serve.loadtest",)),  # the old path of celeris.bench.loadtest, for one release
    (6, "serve", ("celeris.serve",)),
    (7, "batch", ("celeris.batch",)),
    (7, "bench", ("celeris.bench",)),
    (7, "train", ("celeris.train",)),
    (8, "cli", ("celeris.cli",)),
]
FACE = ("celeris", 5, "llm")  # celeris/__init__.py: the public face, on the facade's floor and in its unit


@dataclass(frozen=True)
class Import:
    """One import of module ``source`` (file ``path``, line ``line``) of module ``target``; ``kind``: "top",
    "lazy" (inside a function) or "type-checking"; ``via``: the module named in the statement when ``target`` is
    a package face it runs on the way."""

    source: str
    path: str
    line: int
    target: str
    kind: str
    via: str | None = None

    def where(self) -> str:
        how = "" if self.kind == "top" else f" ({self.kind})"
        through = f" (through {self.via})" if self.via else ""
        return f"{self.path}:{self.line} imports {self.target}{through}{how}"


def modules(root: Path, package: str = "celeris") -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of ``package`` under ``root``."""
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _import_nodes(tree: ast.AST) -> list[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import statement of ``tree`` with its kind: "lazy" under a function (or lambda), else "type-checking"
    under an ``if`` whose test names ``TYPE_CHECKING``, else "top" (the innermost of the two decides); in the order
    of ``ast.walk`` (breadth first), read in one walk."""
    found = []
    queue: deque[tuple[ast.AST, str]] = deque([(tree, "top")])
    while queue:
        node, kind = queue.popleft()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append((node, kind))
            continue
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            kind = "lazy"
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            kind = "type-checking"
        queue.extend((child, kind) for child in ast.iter_child_nodes(node))
    return found


def _owner(name: str, known: dict[str, Path]) -> str | None:
    """The module ``name`` lives in: itself, or its longest dotted prefix that is a module (``a.b.func`` -> ``a.b``)."""
    while name not in known and "." in name:
        name = name.rsplit(".", 1)[0]
    return name if name in known else None


def imports(root: Path, package: str = "celeris") -> list[Import]:
    """Every import between modules of ``package`` (module docstring), with the package faces each one runs."""
    known = modules(root, package)
    found: list[Import] = []
    for source, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        rel = str(path.relative_to(root))
        for node, kind in _import_nodes(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: from the module's package, one level up per extra dot
                    here = source.split(".") if is_package else source.split(".")[:-1]
                    here = here[: len(here) - node.level + 1]
                    base = ".".join(here + ([node.module] if node.module else []))
                names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
            for name in dict.fromkeys(names):
                target = _owner(name, known)
                if target is None or target == source:
                    continue
                found.append(Import(source, rel, node.lineno, target, kind))
                parts = target.split(".")
                for i in range(2, len(parts)):  # the package faces on the way (not the root's, not its own)
                    face = ".".join(parts[:i])
                    if face in known and not source.startswith(face + ".") and face != source:
                        found.append(Import(source, rel, node.lineno, face, kind, via=target))
    return found


def floor_of(module: str) -> tuple[int, str] | None:
    """(floor, unit) of a module (``FLOORS``), or None when no unit covers it."""
    if module == FACE[0]:
        return FACE[1], FACE[2]
    for floor, unit, names in FLOORS:
        if any(module == n or module.startswith(n + ".") for n in names):
            return floor, unit
    return None


def layer_errors(found: list[Import], known: dict[str, Path]) -> list[str]:
    """One line per module of ``known`` without a floor, then one per import against the floors (file, line, both
    units and floors)."""
    errors = [f"{m} has no floor: give it one in tests/test_imports.py FLOORS" for m in known if floor_of(m) is None]
    for imp in found:
        a, b = floor_of(imp.source), floor_of(imp.target)
        if a is None or b is None:
            continue
        if b[0] > a[0] or (b[0] == a[0] and b[1] != a[1]):
            rule = "a higher floor" if b[0] > a[0] else "another unit of its own floor"
            errors.append(f"{imp.where()}: {a[1]} (floor {a[0]}) may not import {b[1]} (floor {b[0]}), {rule}")
    return errors


def circles(found: list[Import]) -> list[list[Import]]:
    """One circle (a closed list of imports) per strongly connected group of modules (Tarjan), shortest first."""
    edges: dict[str, dict[str, Import]] = {}
    for imp in found:
        edges.setdefault(imp.source, {}).setdefault(imp.target, imp)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(v: str) -> None:  # recursion depth is bounded by the number of modules (~100)
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    found_circles = []
    for group in groups:  # the shortest circle through the group's first module (breadth-first)
        start = min(group)
        paths = {start: []}
        queue = [start]
        while queue:
            v = queue.pop(0)
            for w, imp in sorted(edges.get(v, {}).items()):
                if w == start:
                    found_circles.append(paths[v] + [imp])
                    queue = []
                    break
                if w in group and w not in paths:
                    paths[w] = paths[v] + [imp]
                    queue.append(w)
    return sorted(found_circles, key=len)


def circle_message(circle: list[Import]) -> str:
    steps = " -> ".join(f"{i.where()} [{(floor_of(i.source) or (None, '?'))[1]} -> "
                        f"{(floor_of(i.target) or (None, '?'))[1]}]" for i in circle)
    return f"import circle {' -> '.join([circle[0].source] + [i.target for i in circle])}: {steps}"


def check(root: Path, found: list[Import] | None = None) -> list[str]:
    """Every circle and every import against the floors in ``root/celeris``, one message each; ``found``: its
    imports when already read (``imports(root)``)."""
    found = imports(root) if found is None else found
    return [circle_message(c) for c in circles(found)] + layer_errors(found, modules(root))


# ---------------------------------------------------------------------------------------------------------------


@functools.cache
def root_imports() -> list[Import]:
    """The imports of this checkout's ``celeris/``, read once per test process."""
    return imports(ROOT)


def test_the_import_map_has_no_circle_and_runs_down_the_floors():
    found = root_imports()
    assert len({i.source for i in found}) > 70 and {i.kind for i in found} == {"top", "lazy", "type-checking"}
    errors = check(ROOT, found)
    assert not errors, "\n".join(errors)


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_a_lazy_circle_is_found_naming_files_lines_and_units(tmp_path):
    root = _write(tmp_path, {
        "celeris/__init__.py": "",
        "celeris/models/__init__.py": "",
        "celeris/models/loader.py": "def load():\n    from celeris.models.remote import load_remote\n",
        "celeris/models/remote.py": "from celeris.models.loader import load\n",
    })
    assert check(root) == [
        "import circle celeris.models.loader -> celeris.models.remote -> celeris.models.loader: "
        "celeris/models/loader.py:2 imports celeris.models.remote (lazy) [models -> models] -> "
        "celeris/models/remote.py:1 imports celeris.models.loader [models -> models]"]


def test_a_circle_through_a_package_face_is_found(tmp_path):
    """``llm`` importing ``celeris.serve.text`` runs ``serve/__init__.py``, which imports the module that
    imports ``llm``: the runtime circle that forced lazy imports of ``LLM`` before ``celeris/text.py``."""
    root = _write(tmp_path, {
        "celeris/__init__.py": "",
        "celeris/llm.py": "from celeris.serve.detokenize import cut\n",
        "celeris/serve/__init__.py": "from celeris.serve.serving import Serving\n",
        "celeris/serve/detokenize.py": "",
        "celeris/serve/serving.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from celeris.llm import LLM\n",
    })
    errors = check(root)
    assert errors[0].startswith("import circle celeris.llm -> celeris.serve -> celeris.serve.serving -> celeris.llm:")
    assert "celeris/llm.py:1 imports celeris.serve (through celeris.serve.detokenize)" in errors[0]
    assert "celeris/serve/serving.py:3 imports celeris.llm (type-checking) [serve -> llm]" in errors[0]
    assert ("celeris/llm.py:1 imports celeris.serve.detokenize: llm (floor 5) may not import serve (floor 6), "
            "a higher floor") in errors


def test_imports_up_a_floor_or_across_units_of_one_floor_are_refused(tmp_path):
    root = _write(tmp_path, {
        "celeris/__init__.py": "",
        "celeris/text.py": "import celeris.params\n",
        "celeris/params.py": "",
        "celeris/train/__init__.py": "",
        "celeris/train/gate.py": "from celeris.bench.quality import parses\nfrom celeris.params import x\n",
        "celeris/bench/__init__.py": "",
        "celeris/bench/quality.py": "from . import helpers\nfrom .helpers import y\n",
        "celeris/bench/helpers.py": "",
        "celeris/newthing.py": "",
        "celeris/cli.py": "from celeris import newthing\n",
    })
    assert check(root) == [
        "celeris.newthing has no floor: give it one in tests/test_imports.py FLOORS",
        "celeris/text.py:1 imports celeris.params: text (floor 1) may not import sampling (floor 3), a higher floor",
        "celeris/train/gate.py:1 imports celeris.bench.quality: train (floor 7) may not import bench (floor 7), "
        "another unit of its own floor",
        "celeris/train/gate.py:1 imports celeris.bench (through celeris.bench.quality): train (floor 7) may not import "
        "bench (floor 7), another unit of its own floor",
    ]


def test_import_celeris_and_its_sampling_params_load_no_model_module():
    """``import celeris`` and ``from celeris import SamplingParams`` stay off the models (and so off the model
    code): checked in a child interpreter, since this one has imported everything (the child of
    ``tests.fixtures.fresh_interpreter``, which checks the moved modules' old paths after this)."""
    loaded = fresh_interpreter()["celeris_modules"]
    assert "celeris.sampling.params" in loaded and "celeris.params" not in loaded  # the old path is not needed
    assert [m for m in loaded if m == "celeris.models" or m.startswith("celeris.models.")] == []
    assert "celeris.llm" not in loaded  # LLM is loaded on first use


SERVING_STACK = ("celeris.engine", "celeris.llm", "celeris.serve", "celeris.batch")


def reference_leaks(found: list[Import]) -> list[str]:
    """Imports of the reference samplers (``celeris.reference``) from the serving stack: the engine, the facade, the
    server and batch jobs must never run an oracle (the engine is kept from it by the floors too: ``reference`` and
    ``engine`` share floor 4 in two units). One line per import statement (the package face it runs is not
    named again)."""
    return [f"{i.where()}: the serving stack may not run a reference sampler" for i in found
            if i.via is None and any(i.source == s or i.source.startswith(s + ".") for s in SERVING_STACK)
            and (i.target == "celeris.reference" or i.target.startswith("celeris.reference."))]


def test_the_engine_and_the_server_never_import_a_reference_sampler(tmp_path):
    assert reference_leaks(root_imports()) == []
    assert any(i.target.startswith("celeris.reference") for i in root_imports())  # the bench does, for baselines
    root = _write(tmp_path, {
        "celeris/__init__.py": "",
        "celeris/reference/__init__.py": "",
        "celeris/reference/masked.py": "",
        "celeris/engine/__init__.py": "",
        "celeris/engine/engine.py": "def f():\n    from celeris.reference.masked import generate\n",
        "celeris/serve/__init__.py": "",
        "celeris/serve/app.py": "import celeris.reference.masked\n",
    })
    found = imports(root)
    assert reference_leaks(found) == [
        "celeris/engine/engine.py:2 imports celeris.reference.masked (lazy): the serving stack may not run a "
        "reference sampler",
        "celeris/serve/app.py:1 imports celeris.reference.masked: the serving stack may not run a reference sampler"]
    assert any("engine (floor 4) may not import reference (floor 4)" in e for e in check(root))
