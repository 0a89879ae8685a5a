"""A real agent framework (OpenAI's ``openai-agents`` SDK, on the chat-completions API, tracing off: there is
no network) runs a tool-calling loop against the live server: turn 1 is forced to call the tool
(``tool_choice="required"``), the SDK runs it and sends the result back (``role: "tool"``), and turn 2
(``tool_choice`` reset to auto by the SDK) gives the final answer.

Slow tier (~4-8 s: two turns of 160 tokens under grammars, beside seconds of importing the SDK), as its twin on
the Responses API (tests/serve/responses/test_agents.py); the fast tier keeps the same tool loop on the server,
through OpenAI's client (tests/serve/test_structured.py: ``test_two_turn_tool_loop``)."""

from __future__ import annotations

import asyncio

import pytest

from tests.serve.conftest import MODEL_NAME, make_serving


@pytest.mark.slow
def test_openai_agents_completes_a_tool_loop(long_llm):
    agents = pytest.importorskip("agents")  # here, not at collection: the SDK takes seconds to import
    from openai import AsyncOpenAI

    from celeris.serve.app import BackgroundServer, create_app

    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather of a city."""
        calls.append(city)
        return f"sunny in {city}"

    agents.set_tracing_disabled(True)
    serving = make_serving(long_llm)
    with BackgroundServer(create_app(serving)) as srv:
        client = AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
        model = agents.OpenAIChatCompletionsModel(model=MODEL_NAME, openai_client=client)
        agent = agents.Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather],
                             model=model, model_settings=agents.ModelSettings(tool_choice="required",
                                                                              max_tokens=160, temperature=0.7))
        result = asyncio.run(agents.Runner.run(agent, "Weather in Paris?", max_turns=4))
    assert len(calls) >= 1 and all(isinstance(c, str) for c in calls)
    tool_outputs = [item for item in result.new_items if item.type == "tool_call_output_item"]
    assert tool_outputs and tool_outputs[0].output.startswith("sunny in")
    assert isinstance(result.final_output, str)
