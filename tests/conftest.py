"""Shared fixtures: tiny random models built in-process, fake models with scripted logits,
a tiny BPE tokenizer + checkpoint folder, and a tiny fake-stdlib training corpus.

Everything is small enough to run on two busy CPU cores: vocab 64, hidden 32, 2 layers.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # the package is used from the checkout, not installed
    sys.path.insert(0, str(REPO_ROOT))

from celeris.models.celeris import CelerisConfig, CelerisModel  # noqa: E402
from celeris.models.loader import save_checkpoint  # noqa: E402
from celeris.tokenizer import write_tokenizer_config  # noqa: E402
from celeris.train.data import build_stdlib_corpus, train_tokenizer  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "ddp: launches two training processes with torch.distributed.run (~30 s)")
    config.addinivalue_line("markers", "slow: subprocess, Ray, DDP, signal or torch.compile tests; deselected by "
                            "default, run by .ci/run (`pytest -q -m slow -n 0`)")
    config.addinivalue_line("markers", "bench_plots: `celeris bench` draws its PNG plots in this test (the others "
                            "skip them: _no_bench_plots)")


# The machine is shared with a training job: one intra-op thread keeps tests predictable.
torch.set_num_threads(1)


def _share_one_ssl_context() -> None:
    """Every httpx client (inside the official ``openai`` and ``ollama`` clients, and the tests' own) builds an SSL
    context and reads certifi's CA bundle, about 27 ms of CPU, though the tests only speak plain HTTP to
    127.0.0.1: some 340 clients cost about 9 s of the fast tier. One default context, built once, serves them all
    (an ``ssl.SSLContext`` is meant to be shared); any other ``verify``/``cert`` builds its own as before."""
    try:
        from httpx._transports import default
    except ImportError:  # httpx moved its helper: every client builds its own context, as without this
        return
    build = default.create_ssl_context
    shared: dict[str, object] = {}

    def create_ssl_context(verify=True, cert=None, trust_env=True):  # noqa: ANN001, ANN202 - httpx's signature
        if verify is True and cert is None and trust_env:
            if "context" not in shared:
                shared["context"] = build(verify, cert, trust_env)
            return shared["context"]
        return build(verify, cert, trust_env)

    default.create_ssl_context = create_ssl_context


_share_one_ssl_context()

@pytest.fixture(autouse=True)
def _no_bench_plots(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """``celeris bench`` draws two PNGs with matplotlib after every run (about 1 s, and 1.5 s to import it once):
    only tests marked ``bench_plots`` draw them (tests/bench/test_run.py checks the files); the others' benches
    write bench.json alone."""
    if request.node.get_closest_marker("bench_plots") is None:
        monkeypatch.setattr("celeris.bench.run.write_plots", lambda results, out: None)


TINY = {
    "vocab_size": 64,
    "hidden_size": 32,
    "num_layers": 2,
    "num_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 128,
    "eos_token_id": 0,
    "mask_token_id": 1,
    "pad_token_id": 2,
}

PYTHON_SNIPPETS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n",
    "import os\nimport sys\n\n\ndef main(argv=None):\n    for name in sorted(os.listdir('.')):\n"
    "        print(name, file=sys.stdout)\n    return 0\n",
    "def add(a, b):\n    \"\"\"Return the sum of a and b.\"\"\"\n    return a + b\n\n\nresult = add(1, 2)\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print('even', i)\n    else:\n        print('odd', i)\n",
    "with open('data.txt') as handle:\n    lines = [line.strip() for line in handle if line]\n",
]


def tiny_config(**overrides) -> CelerisConfig:
    return CelerisConfig(**{**TINY, **overrides})


CONTEXT_GAIN = 3.0


def tiny_model(seed: int = 0, **overrides) -> CelerisModel:
    """A random eval-mode model whose predictions depend on context and position.

    With PyTorch's default init the residual stream is dominated by each position's own input
    embedding, so every masked position predicts the same token and tests of commit order,
    batching or seeds pass trivially. Scaling every projection by ``CONTEXT_GAIN`` makes attention
    and MLP outputs dominate: answers hold many different tokens and depend on the order in which
    positions are committed.
    """
    torch.manual_seed(seed)
    m = CelerisModel(tiny_config(**overrides)).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() == 2 and not name.startswith("embed_tokens"):
                p.mul_(CONTEXT_GAIN)
    return m


@pytest.fixture
def make_model():
    """Factory: ``make_model(seed=0, **config_overrides)`` -> tiny random CelerisModel."""
    return tiny_model


@pytest.fixture(scope="module")
def model() -> CelerisModel:
    return tiny_model(seed=0)


class ScriptedModel(nn.Module):
    """A fake model whose logits are a function of each token's real position (padding not counted).

    ``table(position) -> (V,) logits`` scripts the prediction at every position; when
    ``uncond_table`` is set, rows whose first real token is the mask token (CFG's unconditional
    pass) use it instead. Records every forward call's input ids.
    """

    def __init__(self, config: CelerisConfig, table, uncond_table=None) -> None:
        super().__init__()
        self.config = config
        self.anchor = nn.Parameter(torch.zeros(1))  # the sampler reads the device from a parameter
        self.table, self.uncond_table = table, uncond_table
        self.calls: list[torch.Tensor] = []

    def forward(self, input_ids, attention_mask=None, logits_slice=None):
        self.calls.append(input_ids.clone())
        b, length = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones(b, length, dtype=torch.bool)
        positions = attention_mask.long().cumsum(-1) - 1  # (B, L)
        first_real = attention_mask.long().argmax(-1)  # (B,)
        is_uncond = input_ids.gather(1, first_real[:, None]).squeeze(1) == self.config.mask_token_id
        out = torch.empty(b, length, self.config.vocab_size)
        for i in range(b):
            table = self.uncond_table if (self.uncond_table is not None and bool(is_uncond[i])) else self.table
            for j in range(length):
                out[i, j] = table(int(positions[i, j]))
        if logits_slice is not None:
            out = out[:, logits_slice]
        return out


@pytest.fixture
def scripted_model():
    """Factory: ``scripted_model(table, uncond_table=None, **config_overrides)``."""

    def build(table, uncond_table=None, **overrides) -> ScriptedModel:
        return ScriptedModel(tiny_config(**overrides), table, uncond_table)

    return build


# ---------------------------------------------------------------------------------------------
# Tokenizer and checkpoint folder


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A ~300-token byte-level BPE trained in-process on short Python text, plus tokenizer_config."""
    folder = tmp_path_factory.mktemp("tokenizer")
    tok = train_tokenizer(iter(PYTHON_SNIPPETS * 4), vocab_size=300)
    tok.save(str(folder / "tokenizer.json"))
    write_tokenizer_config(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_checkpoint(tokenizer_dir, tmp_path_factory) -> Path:
    """A complete checkpoint folder (config, weights, tokenizer, generation config) of a random model."""
    from celeris.tokenizer import Tokenizer

    tok = Tokenizer(tokenizer_dir)
    cfg = tiny_config(
        vocab_size=tok.vocab_size,
        eos_token_id=tok.eos_token_id,
        mask_token_id=tok.mask_token_id,
        pad_token_id=tok.pad_token_id,
        max_position_embeddings=64,
    )
    model = tiny_model(seed=0, **{k: getattr(cfg, k) for k in TINY})
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    generation = {"max_tokens": 16, "steps": 16, "block_length": 8, "temperature": 0.0, "top_p": 1.0,
                  "remasking": "low_confidence", "cfg_scale": 0.0}
    save_checkpoint(model, out, tokenizer_dir, generation)
    return out


# ---------------------------------------------------------------------------------------------
# Training corpus


def write_fake_stdlib(root: Path) -> None:
    """A few .py files (one held out by the 5% rule), plus files the corpus builder must skip."""
    from celeris.train.data import is_held_out

    root.mkdir(parents=True, exist_ok=True)
    body = "\n".join(PYTHON_SNIPPETS)
    names = [f"mod{i}.py" for i in range(4)]
    held = next(f"held{i}.py" for i in range(1000) if is_held_out(f"held{i}.py"))
    for i, name in enumerate([*names, held]):
        (root / name).write_text(f"# module {i}\n{body}\n")
    (root / "pkg").mkdir(exist_ok=True)
    (root / "pkg" / "inner.py").write_text(body)
    (root / "pkg" / "empty.py").write_text("   \n")
    (root / "latin1.py").write_bytes(b"x = '\xe9'\n")  # not UTF-8: skipped
    (root / "site-packages").mkdir(exist_ok=True)
    (root / "site-packages" / "third_party.py").write_text("THIRD_PARTY = True\n")
    (root / "__pycache__").mkdir(exist_ok=True)
    (root / "__pycache__" / "cached.py").write_text("CACHED = True\n")
    (root / "notes.txt").write_text("not python\n")


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    """``build_stdlib_corpus`` output for a tiny fake standard library (vocab 300)."""
    base = tmp_path_factory.mktemp("corpus")
    write_fake_stdlib(base / "fake_stdlib")
    build_stdlib_corpus(base / "data", vocab_size=300, root=base / "fake_stdlib")
    return base / "data"


# LLM(...) settings for the serve tests' tiny checkpoints (hidden 32, decoded through the live servers): PyTorch's
# default matmul, not oneDNN's prepacked linears, whose fixed cost per call (~35 us) is 4x F.linear's at these
# 32-wide layers. The prepacked default is served in tests/serve/test_shipped_model.py and decoded in test_pins.py
# and test_cli.py (the embedded models); tests/models/test_prepack.py checks it against the plain model
TINY_LLM = {"device": "cpu", "onednn": False}


TINY_TRAIN_MODEL = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64}


def stop_server(proc) -> int:
    """SIGINT a `celeris serve` child (graceful shutdown), kill it after 30 s; its exit code."""
    import signal
    import subprocess

    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return proc.returncode


@pytest.fixture
def subprocess_env() -> dict[str, str]:
    """Environment for child Pythons: the checkout on the path, one thread each."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env["OMP_NUM_THREADS"] = "1"
    env["MKL_NUM_THREADS"] = "1"
    return env


def build_tiny_checkpoint(folder: Path, texts: list[str], name: str, context: int, generation_config: dict,
                          is_causal: bool = False, draft_block_size: int = 0) -> Path:
    """Tokenizer (~300 tokens) trained on ``texts`` + a random 2-layer model whose answers vary with
    prompt and seed, saved as checkpoint folder ``folder / name`` (shared by the serve and batch tests);
    ``is_causal`` makes it an autoregressive twin, with ``draft_block_size`` > 0 a hybrid (verified decoding)."""
    from celeris.tokenizer import Tokenizer

    tok_dir = folder / "tokenizer"
    tok_dir.mkdir(parents=True)
    train_tokenizer(iter(texts * 4), vocab_size=300).save(str(tok_dir / "tokenizer.json"))
    write_tokenizer_config(tok_dir)
    tok = Tokenizer(tok_dir)
    cfg = CelerisConfig(vocab_size=tok.vocab_size, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                        max_position_embeddings=context, eos_token_id=tok.eos_token_id,
                        mask_token_id=tok.mask_token_id, pad_token_id=tok.pad_token_id, is_causal=is_causal,
                        draft_block_size=draft_block_size)
    torch.manual_seed(0)
    model = CelerisModel(cfg).eval()
    with torch.no_grad():  # larger projections: predictions depend on context, so answers vary
        for pname, p in model.named_parameters():
            if p.dim() == 2 and not pname.startswith("embed_tokens"):
                p.mul_(3.0)
    return save_checkpoint(model, folder / name, tok_dir, generation_config)
