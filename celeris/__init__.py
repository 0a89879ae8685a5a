"""Celeris: an engine for diffusion language models.

Public API (mirrors vLLM): ``LLM(model).generate(prompts, SamplingParams(...))``.
"""

from celeris.sampling.params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):  # lazy: `import celeris` stays cheap for the CLI
    if name == "LLM":
        from celeris.llm import LLM

        return LLM
    raise AttributeError(name)
