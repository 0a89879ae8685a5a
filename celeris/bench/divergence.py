"""The quality cost of a quantization, measured as llama.cpp's ``llama-perplexity --kl-divergence`` does.

The reference (the unquantized model) decodes a fixed prompt set greedily in one decoding mode; the candidate
(the same checkpoint quantized) is then teacher-forced on the reference's own choices and its per-token
distributions are compared with the reference's:

- a causal model (a next-token or hybrid model, decoded ``verified`` or token by token): one pass over
  prompt + the reference's greedy continuation scores every answer token from its prefix (the distributions the
  greedy verifier and the next-token head use);
- a masked-diffusion model (decoded ``masked``, one block for the whole answer, or ``block``, semi-autoregressive
  blocks): every answer token is scored on the canvas the reference held just before the step that committed
  it (its trajectory recorded step by step through ``LLM.generate``'s ``on_step``), masks and all.

Per token: top-1 agreement (the candidate's argmax equals the reference's) and KL(p_ref || p_cand) in nats.
Free-running: the candidate also decodes the prompts itself, and ``first_divergence`` is the first answer position
where its greedy tokens differ from the reference's (None: the same text).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from celeris.llm import LLM
from celeris.sampling.params import SamplingParams

# quality floors of issue 29, per method family (top-1 agreement at least, mean KL in nats at most)
FLOORS = {"int8": (0.99, 0.01), "int4": (0.90, 0.1),
          # fp8 (W8A8; the issue sets no floor): between int8's and int4's, set after measuring the embedded 6M
          # models on a CPU (top-1 0.984-0.996, KL 0.0010-0.0021 nats in the three modes; docs/quantization.md)
          "fp8": (0.97, 0.01)}
# the embedded 6M models' quality set (tests/bench/test_divergence.py's floors, celeris.bench.gpu_quant on a device):
# decoding mode -> (model, settings); prompts: ``humaneval_prompts``
EMBEDDED_MODES = {
    "masked": ("celeris-code-6m", {"max_tokens": 32, "steps": 32, "block_length": 32, "cache": "none"}),
    "block": ("celeris-code-6m", {"max_tokens": 32, "steps": 32, "block_length": 8}),
    "verified": ("celeris-code-6m-hybrid", {"max_tokens": 32, "decoding": "verified"}),
}
PROMPT_TOKENS = 64  # each quality prompt's last 64 tokens: keeps the masked mode's 32 passes per prompt short


def humaneval_prompts(llm: LLM, n: int = 8) -> list[list[int]]:
    """The bench's first ``n`` HumanEval prompts (healed as the bench does), each cut to its last ``PROMPT_TOKENS``
    token ids of ``llm``'s tokenizer."""
    from celeris.bench.quality import heal_prompt, load_humaneval

    return [llm.tokenizer.encode(heal_prompt(p["prompt"]))[-PROMPT_TOKENS:] for p in load_humaneval()[:n]]


# the chat questions the SmolLM2 quality floors are measured on (tests/models/test_quantize_smollm2.py,
# scripts/int8_floor.py): short requests of several kinds, through the chat template
CHAT_QUESTIONS = ["Write a short email inviting the team to a product demo on Friday afternoon.",
                  "Explain what a hash table is to a ten-year-old.", "Why is the sky blue? Answer in two sentences.",
                  "Write a Python function that returns the factorial of a number.",
                  "Tom has 5 apples and buys 7 more. How many apples does he have now?",
                  "A train travels 60 miles per hour for 3 hours. How far does it go?",
                  "List four benefits of regular exercise.", "Write a haiku about autumn leaves."]
SCORE_BATCH = 16  # canvases per teacher-forced pass of a masked-diffusion model


@dataclass(frozen=True, slots=True)
class Divergence:
    """What ``measure_divergence`` reports (``tokens``: answer tokens scored; positions are answer positions)."""

    tokens: int
    top1_agreement: float
    mean_kl: float
    first_divergence: list[int | None]

    def to_json(self) -> dict:
        return {**asdict(self), "top1_agreement": round(self.top1_agreement, 5), "mean_kl": round(self.mean_kl, 6)}


def floor_of(method: str) -> tuple[float, float]:
    """(top-1 floor, KL ceiling) of a quantization method name (``int4-g64`` is an ``int4``)."""
    base = method.split("+")[0]
    return FLOORS["fp8" if base == "fp8" else "int8" if base.startswith("int8") else "int4"]


def floor_warning(method: str, d: Divergence, floor: str | None = None) -> str | None:
    """A one-line warning naming ``method`` when ``d`` misses the floor of ``floor`` (default: ``method``'s own;
    the bench holds ``bfloat16`` to int8's), else None."""
    top1, kl = floor_of(floor or method)
    if d.top1_agreement >= top1 and d.mean_kl <= kl:
        return None
    held = f" ({floor}'s)" if floor and floor != method else ""
    return (f"warning: {method} misses its quality floor{held}: top-1 agreement {d.top1_agreement:.4f} (floor "
            f"{top1}), mean KL {d.mean_kl:.5f} nats (ceiling {kl})")


def _kl_and_agreement(ref: torch.Tensor, cand: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, V) float32 logits each -> per-row KL(p_ref || p_cand) (N,) and argmax agreement (N,) bool."""
    lp, lq = ref.float().log_softmax(-1), cand.float().log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1).clamp(min=0)
    return kl, ref.argmax(-1) == cand.argmax(-1)


@torch.no_grad()
def _causal_scores(reference: LLM, candidate: LLM, prompt: list[int], answer: list[int]) -> list[torch.Tensor]:
    ids = torch.tensor([prompt + answer], device=reference.device)
    n = len(answer)  # row i predicts token i (the model's forward shifts), so the answer's rows are the last n
    return [m.model(ids)[0, -n:] for m in (reference, candidate)]


@torch.no_grad()
def _trajectory_scores(reference: LLM, candidate: LLM, prompt: list[int], params: SamplingParams,
                       ) -> tuple[list[int], list[torch.Tensor]]:
    """The reference's greedy answer and, per committed token, both models' logits on the canvas before its
    commit."""
    mask_id = reference.model.config.mask_token_id
    states = [torch.full((1, params.max_tokens), mask_id, dtype=torch.long)]
    out = reference.generate([prompt], params, on_step=lambda answer: states.append(answer.detach().cpu().clone()))
    answer = out[0].token_ids
    canvases, picks = [], []  # per step that committed answer tokens: the canvas before it, (row, column) pairs
    for before, after in zip(states, states[1:], strict=False):
        committed = ((before[0] == mask_id) & (after[0] != mask_id)).nonzero().flatten()
        committed = committed[committed < len(answer)]  # only the tokens the answer keeps (before an end token)
        if committed.numel():
            picks += [(len(canvases), len(prompt) + int(c)) for c in committed]
            canvases.append(prompt + before[0].tolist())
    if not canvases:
        return answer, []
    ids = torch.tensor(canvases, device=reference.device)  # (S, T): the steps' canvases scored in batches
    rows, cols = (torch.tensor(x, device=reference.device) for x in zip(*picks, strict=True))
    scored = []
    for m in (reference, candidate):
        logits = torch.cat([m.model(chunk) for chunk in ids.split(SCORE_BATCH)])  # (S, T, V)
        scored.append(logits[rows, cols])
    return answer, scored


def measure_divergence(reference: LLM, candidate: LLM, prompts: list[str | list[int]],
                       params: SamplingParams) -> Divergence:
    """Teacher-forced top-1 agreement and mean KL of ``candidate`` against ``reference`` on the reference's own
    greedy continuations of ``prompts`` decoded with ``params`` (see the module docstring), and the first position
    where each free-running candidate answer leaves the reference's.

    Args:
        reference / candidate: the same checkpoint (same tokenizer), e.g. float32 and ``quantization="int8"``.
        prompts: text (encoded by the reference's tokenizer) or token ids.
        params: the decoding mode; its temperature is set to 0 (greedy).

    Raises:
        ValueError: the two models have different vocabularies; a prompt too long for the context.
    """
    if reference.model.config.vocab_size != candidate.model.config.vocab_size:
        raise ValueError("measure_divergence needs two models of one vocabulary (the same checkpoint)")
    from dataclasses import replace

    params = replace(params, temperature=0.0)
    causal = bool(getattr(reference.model.config, "is_causal", False))
    kls, agree, first = [], [], []
    for prompt in prompts:
        ids = reference.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if causal:
            answer = reference.generate([ids], params)[0].token_ids
            rows = _causal_scores(reference, candidate, ids, answer) if answer else []
        else:
            answer, rows = _trajectory_scores(reference, candidate, ids, params)
        if rows:
            kl, same = _kl_and_agreement(*rows)
            kls.append(kl)
            agree.append(same)
        mine = candidate.generate([ids], params)[0].token_ids
        diff = next((i for i, (a, b) in enumerate(zip(answer, mine, strict=False)) if a != b), None)
        if diff is None and len(answer) != len(mine):
            diff = min(len(answer), len(mine))
        first.append(diff)
    kl_all = torch.cat(kls) if kls else torch.zeros(0)
    same_all = torch.cat(agree) if agree else torch.zeros(0, dtype=torch.bool)
    n = int(kl_all.numel())
    return Divergence(n, float(same_all.float().mean()) if n else 1.0, float(kl_all.mean()) if n else 0.0, first)
