"""``reset_prefix_cache`` (vLLM's ``LLM.reset_prefix_cache``): a prompt seen before is prefilled from the prefix
cache until the cache is emptied, and the answers never change."""

from __future__ import annotations

from celeris.engine.kv import BLOCK_SIZE
from celeris.llm import LLM


def test_a_reset_prefix_cache_prefills_a_prompt_seen_before_in_full():
    llm = LLM("celeris-code-6m-hybrid", device="cpu")
    prompt = ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number, counting from zero: fibonacci(0) is 0 "
              "and fibonacci(1) is 1.\"\"\"\n")
    params = llm.default_params(max_tokens=8, decoding="verified")
    assert len(llm.tokenizer.encode(prompt)) > 2 * BLOCK_SIZE

    def run() -> tuple[list[int], int]:
        ids = llm.generate([prompt], params)[0].token_ids
        return ids, llm.engine.stats().prefix_cache_hits

    first, hits0 = run()
    again, hits1 = run()
    assert hits0 == 0 and hits1 >= 2 * BLOCK_SIZE  # the second prefill took its full blocks from the cache
    assert llm.reset_prefix_cache() is True
    cold, hits2 = run()
    assert hits2 == hits1  # nothing came from the cache after the reset
    assert first == again == cold
    _, hits3 = run()
    assert hits3 - hits2 == hits1 - hits0  # the reset prefill filled the cache again
