"""Several models behind one server (``celeris serve --model A --also-serve B``): requests choose by ``model``.

``ModelRouter`` holds one ``OpenAIServing`` per model (each with its own engine thread, all recording into one
metrics registry with a ``model`` label) and offers the same surface as a single ``OpenAIServing`` to the app
and the server (endpoints, drain, start/stop, and ``async_engine`` as the engines taken together), so the
routes stay thin. A request without ``model`` goes to the first model.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from celeris.serve.metrics import ServerMetrics
from celeris.serve.protocol import (
    APIError,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    ModelCard,
    ModelList,
)
from celeris.serve.serving import IsDisconnected, OpenAIServing


class _Engines:
    """The engine loops of all models, read as one (``/health``, the drain)."""

    def __init__(self, servings: list[OpenAIServing]) -> None:
        self.servings = servings

    @property
    def is_running(self) -> bool:
        return all(s.async_engine.is_running for s in self.servings)

    @property
    def num_in_flight(self) -> int:
        return sum(s.async_engine.num_in_flight for s in self.servings)

    def seconds_without_progress(self) -> float:
        return max(s.async_engine.seconds_without_progress() for s in self.servings)


class ModelRouter:
    """Serves several models; each request goes to the one its ``model`` names (the first when omitted).

    Args:
        servings: one serving layer per model, the default first; their ``model_name`` must differ and their
            metrics must share one registry (pass one ``ServerMetrics`` to each), so /metrics shows them all.

    Raises:
        ValueError: no serving layer, two with the same model name, or metrics in different registries.
    """

    def __init__(self, servings: list[OpenAIServing]) -> None:
        if not servings:
            raise ValueError("a ModelRouter needs at least one model")
        names = [s.model_name for s in servings]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"two served models have the same name {duplicates}; give each its own folder or "
                             "--served-model-name")
        if any(s.metrics.registry is not servings[0].metrics.registry for s in servings):
            raise ValueError("the served models' metrics must share one registry: pass one ServerMetrics to each")
        self.servings = {s.model_name: s for s in servings}
        self.default = servings[0]
        self.metrics: ServerMetrics = self.default.metrics
        self.async_engine = _Engines(servings)
        self.model_name = self.default.model_name

    @property
    def draining(self) -> bool:
        return self.default.draining

    def pick(self, model: str | None) -> OpenAIServing:
        """The serving layer for ``model`` (None: the default).

        Raises:
            APIError: 404 ``model_not_found`` naming the served models.
        """
        if model is None:
            return self.default
        if model not in self.servings:
            raise APIError(404, f"the model '{model}' does not exist; this server serves "
                                f"{', '.join(repr(n) for n in self.servings)}", param="model", code="model_not_found")
        return self.servings[model]

    def start(self) -> None:
        for s in self.servings.values():
            s.start()

    def stop(self) -> None:
        for s in self.servings.values():
            s.stop()

    def begin_drain(self) -> None:
        for s in self.servings.values():
            s.begin_drain()

    def cut_off(self) -> None:
        for s in self.servings.values():
            s.cut_off()

    def show_models(self) -> ModelList:
        return ModelList(data=[s.model_card() for s in self.servings.values()])

    def show_model(self, model_id: str) -> ModelCard:
        return self.pick(model_id).model_card()

    async def create_completion(
        self, request: CompletionRequest, is_disconnected: IsDisconnected | None = None
    ) -> CompletionResponse | AsyncIterator[CompletionStreamResponse]:
        return await self.pick(request.model).create_completion(request, is_disconnected)

    async def create_chat_completion(
        self, request: ChatCompletionRequest, is_disconnected: IsDisconnected | None = None
    ) -> ChatCompletionResponse | AsyncIterator[ChatCompletionChunk]:
        return await self.pick(request.model).create_chat_completion(request, is_disconnected)
