"""llama.cpp on the same GGUF file as the benched Celeris model: the CPU engine a user would run instead.

Optional: ``pip install llama-cpp-python`` (or ``pip install -e ".[llamacpp]"``) builds llama.cpp from source
(minutes: about 9 on 2 cores); nothing is downloaded at run time. Never needed by the tests (they put a fake
``llama_cpp`` module in its place); the chat bench leaves the system out with a note when it is missing.

What runs: ``llama_cpp.Llama`` on the very ``.gguf`` file the Celeris model was loaded from (``LLM.gguf_path``),
with llama.cpp's own kernels at the file's widths (Q4_1 for SmolLM2's alias: its greedy text may differ from the
engine's float32 where two logits are close), ``n_threads`` and ``n_threads_batch`` = ``torch.get_num_threads()``
(``--threads``), ``n_batch`` 512. Each prompt is fed as the token ids Celeris's tokenizer encoded (never
re-tokenized) and decoded greedily (``temp`` 0: llama.cpp's greedy sampler). llama-cpp-python's high-level API
decodes one sequence at a time: a batch runs its prompts one after another (``NOTE``). Its KV cache is cleared
before every prompt (``Llama.reset``): ``Llama.generate`` would otherwise reuse the prefix a prompt shares with the
previous one (the chat template's, or the whole prompt when a warm-up batch is timed again).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

NOTE = ("llama-cpp-python decodes one sequence at a time: a batch's prompts run one after another (latency: the "
        "batch's; TTFT: from the batch's start); the KV cache is cleared before each prompt")


def unavailable_reason(gguf: Path | None) -> str | None:
    """None when llama.cpp can run the benched model, else a one-line note why not: ``llama_cpp`` does not import
    (not installed, or its shared library does not load), or the model was not loaded from a ``.gguf`` file
    (``gguf`` None: ``LLM.gguf_path``)."""
    if gguf is None:
        return "llama.cpp skipped: the model was not loaded from a .gguf file"
    try:
        import llama_cpp  # noqa: F401
    except (ImportError, OSError) as exc:
        return f"llama.cpp skipped: llama_cpp does not import ({exc}); pip install llama-cpp-python"
    return None


def load(gguf: Path, n_ctx: int):  # noqa: ANN201 - llama_cpp.Llama, an optional import
    """``llama_cpp.Llama`` on ``gguf`` with a context of ``n_ctx`` tokens (prompt + answer), as many threads as
    PyTorch uses (``torch.get_num_threads()``, for generation and prompt batches), prompt batches of 512 tokens,
    seed 0, quiet, and a penalty window (``last_n_tokens_size``, 64 by default) of the whole context, so that its
    penalties read every answer token, as Celeris's do (``generate``).

    Raises:
        ImportError: llama_cpp is not installed (see ``unavailable_reason``).
        ValueError: llama.cpp cannot load the file (llama-cpp-python's own error).
    """
    import llama_cpp

    threads = torch.get_num_threads()
    return llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                           n_batch=512, verbose=False, seed=0, last_n_tokens_size=n_ctx)


def generate(llama, prompts: Sequence[Sequence[int]], max_tokens: int,  # noqa: ANN001 - llama_cpp.Llama
             end_ids: Iterable[int] = (), penalties: dict[str, float] | None = None,
             ) -> tuple[list[list[int]], list[int], list[float]]:
    """Greedy answers to a batch of prompts, one prompt after another (llama-cpp-python decodes one sequence).

    Args:
        llama: a ``llama_cpp.Llama`` (``load``).
        prompts: token ids per prompt, fed unchanged (no BOS added, no re-tokenizing).
        max_tokens: most new tokens per answer; capped so prompt + answer fit ``llama.n_ctx()``.
        end_ids: ids that end an answer besides ``llama.token_eos()`` (the Celeris model's end-of-turn ids).
        penalties: the Celeris model's ``repetition_penalty``, ``frequency_penalty`` and ``presence_penalty``
            (default 1, 0, 0), given to llama.cpp's penalties sampler under its names (``repeat_penalty``, ...).
            llama-cpp-python's ``generate`` builds that sampler afresh for each answer and feeds it only the sampled
            tokens, over a window of ``last_n_tokens_size`` (``load``: the whole context): the frequency and
            presence penalties then read what Celeris's read (the answer so far), its repetition penalty does not
            see the prompt, which Celeris's CTRL penalty does.

    Returns:
        (new token ids per prompt, cut before the first end id; forward passes per prompt: one per sampled token,
        the prefill's included, the end id's too; seconds from this call's start to each prompt's first new
        token: prompts later in the batch wait for the ones before them).

    Raises:
        ValueError: a prompt leaves no room for one new token in the context.
    """
    stop = {llama.token_eos(), *end_ids}
    pen = penalties or {}
    start = time.perf_counter()
    outputs, passes, ttfts = [], [], []
    for prompt in prompts:
        room = min(max_tokens, llama.n_ctx() - len(prompt))
        if room < 1:
            raise ValueError(f"a prompt of {len(prompt)} tokens leaves no room in llama.cpp's context of "
                             f"{llama.n_ctx()} tokens")
        llama.reset()  # no reuse of the previous prompt's keys/values: every prompt is prefilled in full
        ids: list[int] = []
        sampled, first = 0, None
        for token in llama.generate(list(prompt), top_k=1, temp=0.0, repeat_penalty=pen.get("repetition_penalty", 1.0),
                                    frequency_penalty=pen.get("frequency_penalty", 0.0),
                                    presence_penalty=pen.get("presence_penalty", 0.0), reset=True):
            first = first if first is not None else time.perf_counter() - start
            sampled += 1  # one forward pass made this token (the prefill the first)
            if token in stop:
                break
            ids.append(token)
            if len(ids) == room:
                break
        outputs.append(ids)
        passes.append(sampled)
        ttfts.append(first if first is not None else time.perf_counter() - start)
    return outputs, passes, ttfts
