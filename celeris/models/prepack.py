"""Float32 linear layers through oneDNN with prepacked weights on CPU: a transform applied to a loaded model (as
quantization is: ``celeris.models.quantize``), never inside a model file.

Why. On a CPU a decoding pass reads every weight once and computes little. PyTorch's default float32 matmul
(MKL's ``sgemm`` through ``F.linear``) repacks the weight on every call that has more than one row, so a pass of
2-8 columns (a verified pass: one token plus drafts) costs about twice a one-column pass, and ``sgemm`` barely
uses a second thread at these sizes. oneDNN's inner-product with a weight reordered once at load
(``torch.ops.mkldnn._reorder_linear_weight``, then ``torch.ops.mkldnn._linear_pointwise``: the path
``torch.compile``'s CPU backend takes for frozen linear weights) reads the stored layout directly. Measured on the
2-core development machine (``scripts/prepack_bench.py``; SmolLM2-135M's shapes, each weight streamed from memory,
ms per call), the 49,152 x 576 output head at 2 threads: 7.4 / 17.3 / 19.4 (``F.linear``) against 3.2 / 3.4 / 5.6
(oneDNN) for 1 / 2 / 8 rows; docs/benchmarks.md has the whole table.

Numbers. The products are float32 sums in another order: they differ from ``F.linear``'s by float32 rounding
(about 4e-6 relative), and a row's result does not depend on how many rows share the call (checked by the tests),
so verified decoding's target columns score as next-token decoding's do.

Small layers stay. oneDNN's call has a fixed cost of about 20 us on this machine (one thread, weight in the cache)
against ``F.linear``'s 3 us for a 32 x 32 weight: a layer below ``MIN_WEIGHT_ELEMENTS`` (128 Ki elements, 512 KiB of
float32) keeps ``F.linear``, where that fixed cost outweighs what the layout saves (the tests' tiny models, the 6M
models' 256 x 256 output projections); SmolLM2-135M's smallest layer has 331,776.

Memory. The reordered copy replaces each linear's weight. A tied output head gets its own reordered copy of the
embedding rows (the table keeps its rows for the input side): for SmolLM2-135M 108 MiB more than the float32
model's 513 MiB.
"""

from __future__ import annotations

import copy
import types

import torch
import torch.nn.functional as F
from torch import nn

from celeris.models.layers import TransformerLM

MIN_WEIGHT_ELEMENTS = 1 << 17  # a smaller linear keeps F.linear (module docstring)


def reordered(weight: torch.Tensor) -> torch.Tensor:
    """A plain (out, in) weight in oneDNN's layout for ``_linear_pointwise`` (an opaque float32 mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().float().contiguous(), None)


def available(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether prepacking applies: float32 weights on a CPU whose PyTorch build has oneDNN (mkldnn)."""
    return torch.device(device).type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


class PrepackedLinear(nn.Module):
    """An ``nn.Linear`` whose weight is held in oneDNN's reordered layout: (..., in) -> (..., out) float32.

    The reordered tensor is an opaque mkldnn tensor kept as a plain attribute (not a parameter or buffer: it has no
    strides, so ``state_dict``, ``.to`` and ``parameters()`` never see it); ``weight`` gives the plain (out, in)
    matrix back on request, for the rare reader.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = reordered(linear.weight)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        """The weight as a plain (out, in) float32 matrix, rebuilt on every read (not on the decoding path)."""
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.float(), self.packed, self.bias, "none", [], "").to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        """``state_dict`` holds the plain ``weight`` (out, in), as the ``nn.Linear`` it replaced wrote it."""
        destination[prefix + "weight"] = self.weight
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict: dict, prefix: str, local_metadata: dict, strict: bool,
                              missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
        """``load_state_dict`` reorders a plain ``weight`` (out, in) into the oneDNN layout."""
        key = prefix + "weight"
        if key in state_dict:
            weight = state_dict[key]
            if tuple(weight.shape) != (self.out_features, self.in_features):
                error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(weight.shape)}, the "
                                  f"shape in current model is {(self.out_features, self.in_features)}")
            else:
                self.packed = reordered(weight)
        elif strict:
            missing_keys.append(key)
        rest = {k: v for k, v in state_dict.items() if k != key}
        super()._load_from_state_dict(rest, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)

    def __deepcopy__(self, memo: dict) -> PrepackedLinear:
        """A copy that shares the reordered weight (an opaque tensor has no storage to copy; nothing writes it)."""
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for name, value in self.__dict__.items():
            object.__setattr__(new, name, value if name == "packed" else copy.deepcopy(value, memo))
        return new


def _packed_logits(self: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """``TransformerLM.logits`` through the prepacked head: (..., hidden) -> (..., vocab_size) float32."""
    return self._celeris_packed_head(hidden)


def _repack_tied_head(model: nn.Module, incompatible_keys: object) -> None:
    """After ``load_state_dict``: the tied head's reordered copy from the embedding rows just loaded."""
    model.__dict__["_celeris_packed_head"].packed = reordered(model.embed_tokens.weight[: model.vocab_size])


def prepack_model(model: nn.Module, min_elements: int | None = None) -> int:
    """Replace every ``nn.Linear`` of ``model`` (in place) by a ``PrepackedLinear``, and score ``model.logits``
    (rebound on the instance, when the model has one) through a prepacked head: its own ``lm_head``, or a reordered
    copy of a tied embedding's first ``vocab_size`` rows. Layers (and a tied head) whose weight has fewer than
    ``min_elements`` entries keep ``F.linear`` (module docstring).

    Args:
        model: a loaded eval-mode model with float32 weights on a CPU (``available``).
        min_elements: the smallest weight prepacked (0: every layer; None: ``MIN_WEIGHT_ELEMENTS``).
    Returns:
        the number of linear layers replaced, the head included.
    Raises:
        ValueError: a weight that is not float32 on a CPU, or a PyTorch without oneDNN.
    """
    min_elements = MIN_WEIGHT_ELEMENTS if min_elements is None else min_elements
    first = next(model.parameters())
    if not available(first.device, first.dtype):
        raise ValueError(f"prepacked linears need float32 weights on a CPU with oneDNN; the model has {first.dtype} "
                         f"on {first.device}")
    # the head is rebound only where ``logits`` is the plain product TransformerLM's is (another family's head may
    # scale or cap the logits): elsewhere ``lm_head`` stays an nn.Linear, as that family's ``logits`` reads it
    plain_head = getattr(type(model), "logits", None) is TransformerLM.logits
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)
               and (plain_head or name != "lm_head") and m.weight.numel() >= min_elements]
    for name, linear in targets:
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        setattr(parent, name.rpartition(".")[2], PrepackedLinear(linear))
    if plain_head and isinstance(getattr(model, "embed_tokens", None), nn.Embedding):
        head = getattr(model, "lm_head", None)
        if head is None:  # tied: a reordered copy of the rows scores, the table embeds
            rows = model.embed_tokens.weight[: model.vocab_size].detach()
            if rows.numel() < min_elements:
                return len(targets)
            tied = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device="meta")
            tied.weight = nn.Parameter(rows, requires_grad=False)
            head = PrepackedLinear(tied)
            targets.append(("lm_head (tied)", tied))
            model.register_load_state_dict_post_hook(_repack_tied_head)
        elif not isinstance(head, PrepackedLinear) or head.out_features != model.vocab_size:
            return len(targets)  # a small head, or a padded one (logits reads its rows, rebuilt per call)
        model.__dict__["_celeris_packed_head"] = head
        model.logits = types.MethodType(_packed_logits, model)
    return len(targets)


def weight_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The model's parameters and the reordered weights of its prepacked linears (opaque tensors ``parameters()``
    does not list): what a parameter count or a weight size reads (a tied head's reordered copy is not a weight of
    its own and is left out)."""
    return [*model.parameters(), *(m.packed for m in model.modules() if isinstance(m, PrepackedLinear))]


def reference_linear(x: torch.Tensor, module: PrepackedLinear) -> torch.Tensor:
    """The slow, obviously correct product the tests compare with: ``F.linear`` on the plain weight."""
    return F.linear(x.float(), module.weight, module.bias)
