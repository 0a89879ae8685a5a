"""OpenAI's ``openai-agents`` SDK in its default mode (the Responses API; tracing off: there is no network)
completes a tool loop against the live server: turn 1 is forced to call the tool, whose argument is a nested
pydantic model; the SDK validates the arguments into it, runs the tool and sends the result back as a
``function_call_output`` item; turn 2 (``tool_choice`` reset to auto by the SDK) gives the final answer, a
pydantic ``output_type`` (sent as ``text.format`` on every turn, as the SDK does)."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import BaseModel, Field

from tests.serve.conftest import MODEL_NAME


class Place(BaseModel):
    city: str = Field(max_length=8)
    country: str = Field(max_length=8)


class Forecast(BaseModel):
    """The agent's final answer (a short JSON object: its turn ends under the grammar, soon)."""

    sky: str = Field(max_length=8)


class Query(BaseModel):
    place: Place  # nested: the SDK sends the schema with $defs / $ref, the grammar enforces it
    days: int = Field(ge=1, le=7)


def run_agent(url: str, streamed: bool) -> tuple[list[Query], object]:
    agents = pytest.importorskip("agents")  # here, not at collection: the SDK takes seconds to import
    from openai import AsyncOpenAI

    calls: list[Query] = []

    @agents.function_tool
    def get_forecast(query: Query) -> str:
        """The weather forecast of a place."""
        calls.append(query)
        return f"sunny in {query.place.city}"

    agents.set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    model = agents.OpenAIResponsesModel(model=MODEL_NAME, openai_client=client)  # the SDK's default model class
    settings = agents.ModelSettings(tool_choice="required", max_tokens=160, temperature=0.7,
                                    extra_body={"seed": 0})
    agent = agents.Agent(name="weather", instructions="Answer with the weather.", tools=[get_forecast],
                         model=model, model_settings=settings, output_type=Forecast)

    async def go():
        if not streamed:
            return await agents.Runner.run(agent, "Weather in Paris?", max_turns=4)
        result = agents.Runner.run_streamed(agent, "Weather in Paris?", max_turns=4)
        async for _ in result.stream_events():
            pass
        return result

    return calls, asyncio.run(go())


@pytest.mark.slow  # ~7 s: two turns of 160 tokens under grammars
@pytest.mark.parametrize("streamed", [False, True])
def test_openai_agents_completes_a_tool_loop_on_the_responses_api(rserver, streamed):
    calls, result = run_agent(rserver.url, streamed)
    assert calls and all(isinstance(c, Query) and isinstance(c.place, Place) for c in calls)
    outputs = [item for item in result.new_items if item.type == "tool_call_output_item"]
    assert outputs and outputs[0].output == f"sunny in {calls[0].place.city}"
    assert result.new_items[-1].type == "message_output_item" and isinstance(result.final_output, Forecast)
