"""Agent frameworks with their defaults against the bundled demo server, launched with no tool
flag: LangChain's bind_tools (tool_choice left out, so "auto", parsed in the format the demo's
chat template shows) through a tool round trip, a LangGraph ReAct agent doing the same, LangChain
on the Responses API, and the OpenAI Agents SDK's default model (the Responses API).

The demo model was trained to transform its input, not to call tools: where a test needs a
call, a regex (vLLM's guided_regex) steers the output into the Hermes form the server then has to
find and parse, as it would find a real model's."""

from __future__ import annotations

from typing import Literal

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from tests.server_harness import running_server

WORDS = "the red fox ate 42 fish"
HERMES_CALL = (r'Checking\. <tool_call>\{"name": "get_time", "arguments": '
               r'\{"zone": "(UTC|CET)"\}\}</tool_call>')


@tool
def get_time(zone: Literal["UTC", "CET"]) -> str:
    """The time in a zone."""
    return "12:00"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(None, {}, tmp_path_factory.mktemp("agents") / "server.log") as proc:
        yield proc


def chat_model(server, steered: bool = False, **kw) -> ChatOpenAI:
    extra = {"extra_body": {"guided_regex": HERMES_CALL}} if steered else {}
    return ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model="radixlora-demo",
                      temperature=0, max_tokens=120, max_retries=0, **extra, **kw)


def test_bind_tools_with_the_default_tool_choice_round_trip(server):
    question = HumanMessage("what time is it?")
    asked = chat_model(server, steered=True).bind_tools([get_time]).invoke([question])
    (call,) = asked.tool_calls
    assert call["name"] == "get_time" and call["args"]["zone"] in ("UTC", "CET")
    assert asked.content == "Checking."
    result = get_time.invoke(call)
    assert isinstance(result, ToolMessage) and result.tool_call_id == call["id"]
    final = chat_model(server).bind_tools([get_time]).invoke([question, asked, result])
    assert final.tool_calls == [] and isinstance(final.content, str)


def test_a_langgraph_react_agent_calls_its_tool_and_answers(server):
    from langgraph.prebuilt import create_react_agent

    def model(state, runtime):
        """Steered into a call until the tool has answered."""
        answered = isinstance(state["messages"][-1], ToolMessage)
        return chat_model(server, steered=not answered).bind_tools([get_time])

    out = agent_messages(create_react_agent(model, [get_time]))
    assert [type(m) for m in out] == [HumanMessage, AIMessage, ToolMessage, AIMessage]
    assert out[1].tool_calls[0]["name"] == "get_time" and out[2].content == "12:00"
    assert not out[3].tool_calls


def agent_messages(agent) -> list:
    return agent.invoke({"messages": [("user", "what time is it?")]},
                        {"recursion_limit": 6})["messages"]


def test_langchain_on_the_responses_api(server):
    model = ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model="upper",
                       temperature=0, max_tokens=40, max_retries=0, use_responses_api=True)
    answer = model.invoke(WORDS)
    assert answer.text.strip() == WORDS.upper()


def test_the_agents_sdk_default_model_answers(server):
    from agents import Agent, Runner, set_default_openai_client, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # its traces would go to OpenAI
    set_default_openai_client(AsyncOpenAI(base_url=server.url + "/v1", api_key="unused",
                                          max_retries=0), use_for_tracing=False)
    agent = Agent(name="shouter", instructions="repeat the input in capitals", model="upper")
    result = Runner.run_sync(agent, WORDS)
    assert result.final_output.strip() == WORDS.upper()
