"""Rotary position embeddings with the context-extension scalings of published checkpoints.

A config.json describes its RoPE as transformers does: ``rope_theta`` plus ``rope_scaling`` (transformers 4) or
one ``rope_parameters`` dict holding ``rope_theta`` too (transformers 5); ``type`` is the old name of
``rope_type``. Four types are computed, each as ``transformers.modeling_rope_utils`` (5.24) computes its inverse
frequencies and its attention factor (a multiplier of cos and sin):

- ``default``: ``inv_freq[j] = theta ** (-2j / dim)`` (RoPE, arXiv:2104.09864), factor 1;
- ``linear``: position interpolation (Chen et al., arXiv:2306.15595): ``inv_freq / factor``;
- ``llama3``: Llama 3.1's frequency-dependent interpolation: wavelengths under
  ``original_max_position_embeddings / high_freq_factor`` are kept, those over ``... / low_freq_factor`` are
  divided by ``factor``, the band between is interpolated smoothly (Meta's ``apply_scaling`` in llama-models);
- ``yarn``: YaRN (Peng et al., arXiv:2309.00071): per-dimension blend of interpolated and extrapolated
  frequencies over a linear ramp between the correction dimensions of ``beta_fast`` / ``beta_slow`` rotations,
  and the attention factor ``0.1 ln(factor) + 1`` (or ``attention_factor``, or DeepSeek's mscale ratio).

Any other type (``dynamic``, ``longrope``, ...) is refused naming it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields

import torch

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """One checkpoint's RoPE type and its parameters (the keys of transformers' ``RopeParameters``).

    ``original_max_position_embeddings``: the context the model was pretrained with (llama3, yarn; defaults to
    the config's ``max_position_embeddings``, as transformers' ``standardize_rope_params`` does).
    """

    rope_type: str = "default"
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float | None = None
    beta_slow: float | None = None
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


def read_rope(raw: dict, max_position_embeddings: int, default_theta: float) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling or None for plain RoPE) from a config.json dict ``raw``.

    Raises:
        ValueError: a rope type outside ``ROPE_TYPES`` (named), or a scaling without its ``factor``.
    """
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"rope_parameters must be an object, got {params!r}")
    theta = float(params.get("rope_theta", raw.get("rope_theta") or default_theta))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope type '{rope_type}' is not implemented (only {', '.join(ROPE_TYPES[:-1])} and "
                         f"{ROPE_TYPES[-1]} are)")
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn" and params.get("factor") is None:
        raise ValueError(f"rope type '{rope_type}' needs a 'factor'")
    known = {f.name for f in fields(RopeScaling)}
    values = {k: v for k, v in params.items() if k in known and v is not None}
    values.setdefault("original_max_position_embeddings", raw.get("original_max_position_embeddings")
                      or max_position_embeddings)
    if rope_type == "yarn" and "factor" not in values:  # transformers: the ratio of the two contexts
        values["factor"] = max_position_embeddings / values["original_max_position_embeddings"]
    return theta, RopeScaling(**{**values, "rope_type": rope_type})


def rope_frequencies(dim: int, theta: float, scaling: RopeScaling | None,
                     device: torch.device | str | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies (dim / 2,) float32, attention factor) of a rotary embedding over ``dim`` dimensions."""
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, device=device).float() / dim)  # (dim / 2,)
    if scaling is None:
        return inv_freq, 1.0
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor, 1.0
    if scaling.rope_type == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    return _yarn(dim, theta, scaling, inv_freq.device)


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1's scaling of ``inv_freq`` (dim / 2,)."""
    old = s.original_max_position_embeddings
    low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)  # long wavelengths: interpolated
    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(dim: int, theta: float, s: RopeScaling, device: torch.device) -> tuple[torch.Tensor, float]:
    """YaRN's inverse frequencies and attention factor."""
    old = s.original_max_position_embeddings
    factor = s.factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s.attention_factor
    if attention is None:
        attention = mscale(factor, s.mscale) / mscale(factor, s.mscale_all_dim) if s.mscale and s.mscale_all_dim \
            else mscale(factor)

    def correction_dim(rotations: float) -> float:  # the dimension that turns ``rotations`` times over ``old``
        return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast or 32), correction_dim(s.beta_slow or 1)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, device=device).float() / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: extrapolate (high frequencies), 0: interpolate
    return interpolated * (1 - keep) + extrapolated * keep, float(attention)


@functools.lru_cache(maxsize=16)
def _frequencies(dim: int, theta: float, scaling: RopeScaling | None, device: torch.device) -> tuple[torch.Tensor,
                                                                                                     float]:
    """``rope_frequencies``, computed once per model and device (a decoding step would make it again each pass;
    the tensor is shared: callers read it only)."""
    return rope_frequencies(dim, theta, scaling, device)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, scaling: RopeScaling | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables (RoPE, arXiv:2104.09864): integer ``positions`` (B, L) -> cos, sin each (B, 1, L, head_dim),
    float32; ``scaling``: a context-extension scaling (its frequencies, and its attention factor multiplying cos
    and sin)."""
    inv_freq, attention_factor = _frequencies(head_dim, theta, scaling, positions.device)  # (head_dim/2,)
    angles = positions.float()[..., None] * inv_freq  # (B, L, head_dim/2)
    angles = torch.cat([angles, angles], dim=-1)  # (B, L, head_dim)
    if attention_factor == 1.0:
        return angles.cos()[:, None], angles.sin()[:, None]
    return (angles.cos() * attention_factor)[:, None], (angles.sin() * attention_factor)[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, H, L, D) by the half-split RoPE convention used by Llama."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)
