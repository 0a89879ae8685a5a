"""OpenAI-compatible serving: protocol models, a serving layer usable without HTTP, thin FastAPI routes.

``celeris serve --model PATH`` runs it: POST /v1/completions (``suffix`` = infilling), POST
/v1/chat/completions, GET /v1/models[/{id}], GET /health, GET /metrics (Prometheus).
``OpenAIServing.from_model(PATH)`` gives the same layer to batch jobs;
``python -m celeris.bench.loadtest`` measures it under concurrency.

Layout: ``protocol`` (pydantic models, error shape, body parsing), ``serving`` (requests -> engine
calls -> responses), ``async_engine`` (the one thread that drives ``Engine.step()``), ``detokenize``
(the ``celeris`` extension objects of a choice; the streamed text itself, which never splits a character or leaks a
stop string, is ``celeris.text``), ``app`` (routes: JSON or SSE),
``middleware`` (request ids, body size and deadline, refusal while draining), ``server`` (uvicorn with a
header deadline, bounded sockets and a drain on SIGTERM), ``metrics``; ``ray`` (the same app on Ray Serve, in front
of engine replicas; ``celeris serve --num-replicas N``) with ``remote`` (the engine seam it talks through).
"""

from celeris.serve.protocol import APIError, ErrorResponse
from celeris.serve.serving import OpenAIServing

__all__ = ["APIError", "ErrorResponse", "OpenAIServing"]
