"""The reference samplers: slow, obviously correct loops the tests hold the engine to, token for token.

- ``masked.generate``: masked diffusion (LLaDA's semi-autoregressive remasking); it hands a block-diffusion
  request to ``block.generate_block`` (``celeris.sampling.modes.mode_of``), as it always did;
- ``block.generate_block``: block diffusion, the whole canvas recomputed at every step;
- ``autoregressive.generate_autoregressive``: next-token decoding with a KV cache, the causal twin's baseline.

They share every decoding rule with the engine through ``celeris.sampling`` and nothing else: the engine
(``celeris.engine``) and the server never import this package (``tests/test_imports.py``), and the bench uses it
for its baselines.
"""

from celeris.reference.autoregressive import generate_autoregressive
from celeris.reference.block import generate_block
from celeris.reference.masked import generate

__all__ = ["generate", "generate_autoregressive", "generate_block"]
