"""What Ollama's model routes tell about the served models (``/api/tags``, ``/api/show``, ``/api/ps``), and model
names as Ollama writes them (``name:tag``; ``:latest`` is the served name itself).

Celeris serves the models it was started with: nothing is pulled, created or deleted, and every served model is
loaded ("running") for the server's life.
"""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime

from celeris.models.prepack import weight_tensors
from celeris.sampling.params import rename_deprecated
from celeris.serve.errors import APIError
from celeris.serve.ollama.protocol import ModelDetails, ModelEntry, ShowResponse

NEVER_EXPIRES = "2318-01-01T00:00:00Z"  # what Ollama shows for a model kept loaded for good (keep_alive -1)
DTYPE_NAMES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
# generation_config names -> Ollama's parameter names (the rest keep their Celeris names)
PARAMETER_NAMES = {"max_tokens": "num_predict", "repetition_penalty": "repeat_penalty"}


def servings_of(serving) -> list:
    """The ``OpenAIServing`` of each served model (one, or a ``ModelRouter``'s), the default first."""
    return list(serving.servings.values()) if hasattr(serving, "servings") else [serving]


def tagged(name: str) -> str:
    """A served name as Ollama lists it: ``name:latest`` unless it has a tag already."""
    return name if ":" in name else f"{name}:latest"


def resolve(serving, name: str) -> object:
    """The ``OpenAIServing`` serving ``name`` (the served name, or it with ``:latest``).

    Raises:
        APIError: 404 naming the served models.
    """
    servings = servings_of(serving)
    for s in servings:
        if name in (s.model_name, tagged(s.model_name)):
            return s
    served = ", ".join(f"'{tagged(s.model_name)}'" for s in servings)
    raise APIError(404, f"model '{name}' not found; Celeris serves the models it was started with ({served}) and "
                        "cannot pull others", param="model", code="model_not_found")


def architecture(s) -> str:
    """The model family: a GGUF's ``general.architecture``, else the config's ``model_type`` (lower case)."""
    card = getattr(s.llm, "card", None) or {}
    return str(card.get("architecture") or getattr(s.llm.model.config, "model_type", None)
               or type(s.llm.model).__name__).lower()


def parameter_count(s) -> int:
    return sum(p.numel() for p in weight_tensors(s.llm.model))


def size_bytes(s) -> int:
    return sum(p.numel() * p.element_size() for p in weight_tensors(s.llm.model))


def human_count(n: int) -> str:
    """A parameter count as Ollama writes it (``135M``, ``7.6B``)."""
    if n >= 1e9:
        return f"{n / 1e9:.1f}B"
    return f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def details(s) -> ModelDetails:
    card = getattr(s.llm, "card", None) or {}
    arch = architecture(s)
    dtype = str(getattr(s.llm, "dtype", "float32")).removeprefix("torch.")
    return ModelDetails(format="gguf" if card.get("format") == "gguf" else "safetensors", family=arch,
                        families=[arch], parameter_size=human_count(parameter_count(s)),
                        quantization_level=quantization_level(s, dtype))


def quantization_level(s, dtype: str) -> str:  # noqa: ANN001 - an OpenAIServing
    """Ollama's ``quantization_level``: the ``--quantization`` method (``INT8``, ``INT4-G64``, ``GGUF``) when the
    weights are quantized, else the dtype's name (``F32``, ``BF16``, ``F16``)."""
    applied = getattr(s.llm, "quantization", None)
    if isinstance(applied, dict):
        return str(applied["method"]).upper()
    return DTYPE_NAMES.get(dtype, dtype.upper())


def modified_at(s) -> str:
    try:
        mtime = (s.llm.path / "config.json").stat().st_mtime
    except (OSError, TypeError, AttributeError):
        return datetime.now(UTC).isoformat().replace("+00:00", "Z")
    return datetime.fromtimestamp(mtime, UTC).isoformat().replace("+00:00", "Z")


def digest(s) -> str:
    """A stable id of the served model (sha256 of its name, folder and parameter count; not a file digest)."""
    return hashlib.sha256(f"{s.model_name}\n{s.llm.path}\n{parameter_count(s)}".encode()).hexdigest()


def entry(s, running: bool = False) -> ModelEntry:
    """One model of ``/api/tags`` (``running``: of ``/api/ps``)."""
    name = tagged(s.model_name)
    size = size_bytes(s)
    extra = {}
    if running:
        on_gpu = str(getattr(s.llm, "device", "cpu")).startswith("cuda")
        extra = {"expires_at": NEVER_EXPIRES, "size_vram": size if on_gpu else 0, "context_length": s.context_length}
    return ModelEntry(name=name, model=name, modified_at=None if running else modified_at(s), size=size,
                      digest=digest(s), details=details(s), **extra)


def can_infill(s) -> bool:
    """Whether the model takes a ``suffix`` (masked diffusion), as the serving layer would decide."""
    try:
        s.llm.check(s.llm.default_params(), has_suffix=True)
    except ValueError:
        return False
    return True


def parameters(s) -> list[tuple[str, object]]:
    """The generation defaults as (Ollama name, value) pairs, one per stop string."""
    out = []
    for key, value in rename_deprecated(dict(getattr(s.llm, "generation_config", {}) or {})).items():
        values = value if key == "stop" and isinstance(value, list) else [value]
        if all(isinstance(v, bool | int | float | str) for v in values):
            out += [(PARAMETER_NAMES.get(key, key), v) for v in values]
    return out


def show(s) -> ShowResponse:
    """``/api/show``: details, ``model_info`` (GGUF-style keys, ``<arch>.context_length`` the served context),
    ``capabilities``, the chat template (Jinja, as the checkpoint ships it) and the generation defaults."""
    arch, config = architecture(s), s.llm.model.config
    info: dict[str, object] = {"general.architecture": arch, "general.basename": s.model_name,
                               "general.parameter_count": parameter_count(s), f"{arch}.context_length": s.context_length}
    for key, names in (("embedding_length", ("hidden_size",)), ("block_count", ("num_layers", "num_hidden_layers")),
                       ("attention.head_count", ("num_heads", "num_attention_heads"))):
        value = next((getattr(config, n) for n in names if isinstance(getattr(config, n, None), int)), None)
        if value is not None:
            info[f"{arch}.{key}"] = value
    template = s.tokenizer.chat_template or ""
    capabilities = ["completion", *["tools"] * bool(template), *["insert"] * can_infill(s)]
    params = parameters(s)
    text = "\n".join(f"{k} {v}" for k, v in params)
    modelfile = "\n".join([f"# Modelfile of '{tagged(s.model_name)}', served by Celeris", f"FROM {s.model_name}",
                           *(f"PARAMETER {k} {v}" for k, v in params)]) + "\n"
    card = getattr(s.llm, "card", None) or {}
    return ShowResponse(modelfile=modelfile, parameters=text, template=template, license=str(card.get("license") or ""),
                        details=details(s), model_info=info, capabilities=capabilities, modified_at=modified_at(s))
