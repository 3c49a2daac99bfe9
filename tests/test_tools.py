"""Tool calling: the parsers of each family's format on their own, the tools reaching a chat
template, and against the bundled demo launched with --tool-call-parser hermes through the
openai SDK: a named function and "required" (structured output: the arguments validate
against the schema whatever the adapter), "auto" (the parser finds a Hermes call the output
was steered into by a regex), streamed and not, and the 400s."""

from __future__ import annotations

import json
from typing import Literal

import openai
import pydantic
import pytest

from radixlora.errors import InvalidRequestError
from radixlora.protocol.tools import (
    PARSERS,
    ToolChoice,
    calls_of_required,
    check_tools,
    detect_parser,
    named_structure,
    required_structure,
)
from radixlora.text.chat import ChatMessage, ChatTemplate, template_sources
from tests.server_harness import running_server

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                                    "days": {"type": "integer", "minimum": 1,
                                                             "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]


# ---- parsers and schemas ---------------------------------------------------------------------


@pytest.mark.parametrize("parser, text, content, calls", [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n'
               '</tool_call>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Rome", '
               '"days": 2}}</tool_call>', "Let me look.",
     [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Rome", "days": 2})]),
    ("qwen25", '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}', None,
     [("get_time", {"zone": "CET"})]),
    ("hermes", "No call here.", "No call here.", []),
    ("hermes", "<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}; '
                    '{"name": "get_weather", "parameters": {"city": "Paris; France", "days": 1}}',
     None, [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Paris; France",
                                                            "days": 1})]),
    ("llama3", "It is sunny.", "It is sunny.", []),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}]',
     "Sure.", [("get_time", {"zone": "UTC"})]),
    ("mistral", "[TOOL_CALLS] nothing", "[TOOL_CALLS] nothing", []),
    ("phi4_mini_json", 'I will check. functools[{"name": "get_time", "arguments": {"zone": '
                       '"UTC"}}, {"name": "get_weather", "arguments": {"city": "Rome", '
                       '"days": 3}}]', "I will check.",
     [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Rome", "days": 3})]),
    ("phi4_mini", "functools[not json]", "functools[not json]", []),
    ("pythonic", '[get_weather(city="Rome", days=2), get_time(zone="UTC")]', None,
     [("get_weather", {"city": "Rome", "days": 2}), ("get_time", {"zone": "UTC"})]),
    ("pythonic", "[1, 2, 3]", "[1, 2, 3]", []),
    ("pythonic", '[get_time(zone=__import__("os").system("x"))]',
     '[get_time(zone=__import__("os").system("x"))]', []),
    ("pythonic", "[f(*args)]", "[f(*args)]", []),
    ("pythonic", "Sunny all week.", "Sunny all week.", []),
])
def test_parsers_split_content_and_calls(parser, text, content, calls):
    got_content, got = PARSERS[parser]().parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


def test_streamable_content_stops_where_a_call_may_begin():
    hermes = PARSERS["hermes"]()
    assert hermes.streamable("Hello <tool") == len("Hello ")
    assert hermes.streamable("Hello <tool_call>{") == len("Hello ")
    assert hermes.streamable("Hello there") == len("Hello there")
    llama = PARSERS["llama3_json"]()
    assert llama.streamable('  {"name"') == 0 and llama.streamable("<|python") == 0
    assert llama.streamable("Sunny") == 5
    pythonic = PARSERS["pythonic"]()
    assert pythonic.streamable(" [get_ti") == 0 and pythonic.streamable("Sunny") == 5
    phi = PARSERS["phi4_mini_json"]()
    assert phi.streamable("Checking functools") == len("Checking ")


# excerpts of the chat templates the families ship, where their tool-call formats show
QWEN = ('{%- if tools %}... For each function call, return a json object with function name and '
        'arguments within <tool_call></tool_call> XML tags ...')
MISTRAL = "{%- if message.tool_calls %}{{- \"[TOOL_CALLS][\" }}..."
LLAMA31 = ('{%- if builtin_tools is defined or tool_call.name ... "<|python_tag|>" ... '
           'Respond in the format {"name": function name, "parameters": dictionary of argument '
           'name and its value}.')
PHI4_MINI = "{{ '<|system|>' + message['content'] + '<|tool|>' + message['tools'] + '<|/tool|>' }}"
PYTHONIC = "... [func_name1(params_name1=params_value1, params_name2=params_value2...), ...]"
GEMMA3 = "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}..."


@pytest.mark.parametrize("templates, parser", [
    ([QWEN], "hermes"), ([MISTRAL], "mistral"), ([LLAMA31], "llama3_json"),
    ([PHI4_MINI], "phi4_mini_json"), ([GEMMA3, PYTHONIC], "pythonic"), ([GEMMA3], None),
])
def test_the_parser_is_found_in_the_chat_templates(templates, parser):
    assert detect_parser(templates) == parser


def test_named_templates_are_all_searched(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "default", "template": GEMMA3}, {"name": "tool_use", "template": QWEN}]}))
    assert template_sources(tmp_path) == [GEMMA3, QWEN]
    assert template_sources(tmp_path, "{{ x }}") == ["{{ x }}"]
    assert detect_parser(template_sources(tmp_path)) == "hermes"


def test_auto_without_a_parser_returns_the_text_as_content():
    choice = ToolChoice("auto", parser=None)
    text = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    assert choice.split(text) == (text, []) and choice.streamable(text) == len(text)


def test_tool_checks_and_the_schemas_that_constrain_calls():
    schemas = check_tools(TOOLS)
    assert list(schemas) == ["get_weather", "get_time"]
    for bad, why in (([{"type": "function", "function": {"name": "a b"}}], "name"),
                     ([TIME, TIME], "twice"),
                     ([{"type": "retrieval"}], "must be"),
                     ([{"type": "function", "function": {"name": "f", "parameters": 3}}],
                      "parameters")):
        with pytest.raises(InvalidRequestError) as e:
            check_tools(bad)
        assert e.value.param == "tools" and why in e.value.message
    with pytest.raises(InvalidRequestError) as e:
        named_structure(schemas, "nope")
    assert e.value.param == "tool_choice"
    array = json.loads(required_structure(schemas, parallel=False).value)
    assert array["maxItems"] == 1 and len(array["items"]["anyOf"]) == 2
    text = '[{"name": "get_time", "parameters": {"zone": "UTC"}}]'
    assert [(c.name, c.arguments) for c in calls_of_required(text)] == [
        ("get_time", '{"zone": "UTC"}')]
    assert calls_of_required('[{"name": "get_ti') == []
    message, finish = ToolChoice("required").message('[{"name": "get_ti', "length")
    assert message == {"role": "assistant", "content": '[{"name": "get_ti'} and finish == "length"


def test_tools_and_calls_reach_the_chat_template():
    template = ChatTemplate(
        "{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
        "{% for c in m.tool_calls or [] %}{{ c.function.name }}({{ c.function.arguments.zone }})"
        "{% endfor %}{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %}{% endfor %}")
    messages = [ChatMessage(role="user", content="time?"),
                ChatMessage(role="assistant", content="", tool_calls=[
                    {"id": "c1", "type": "function",
                     "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]),
                ChatMessage(role="tool", content="12:00", tool_call_id="c1")]
    text = template.prompt([m.as_dict() for m in messages], tools=TOOLS)
    assert text == "[get_weather][get_time]<user>time?<assistant>get_time(UTC)<tool>12:00#c1"


# ---- against the demo server -----------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(None, {}, tmp_path_factory.mktemp("tools") / "server.log",
                        "--tool-call-parser", "hermes", "--enable-auto-tool-choice") as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _ask(client, model="radixlora-demo", max_tokens=80, **kw):
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "weather in rome?"}],
        max_tokens=max_tokens, temperature=0, tools=TOOLS, **kw)


def _arguments_valid(name: str, arguments: str) -> None:
    args = json.loads(arguments)
    if name == "get_weather":
        assert set(args) == {"city", "days"} and args["city"] in ("Paris", "Rome")
        assert 1 <= args["days"] <= 7
    else:
        assert args == {"zone": args["zone"]} and args["zone"] in ("UTC", "CET")


@pytest.mark.parametrize("model", ["radixlora-demo", "upper", "json"])
def test_named_and_required_tool_choice_give_valid_calls(client, model):
    named = _ask(client, model, tool_choice={"type": "function",
                                             "function": {"name": "get_weather"}})
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    _arguments_valid(call.function.name, call.function.arguments)
    required = _ask(client, model, tool_choice="required", parallel_tool_calls=False)
    (call,) = required.choices[0].message.tool_calls
    assert required.choices[0].finish_reason == "tool_calls"
    _arguments_valid(call.function.name, call.function.arguments)


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_by_max_tokens_is_content_for_named_and_required(client, stream):
    """One behaviour: a call whose arguments were cut never reaches tool_calls (no client could
    parse them); the text comes back as content with finish_reason length."""
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        if stream:
            chunks = list(_ask(client, max_tokens=6, tool_choice=choice, stream=True))
            content = "".join(c.choices[0].delta.content or "" for c in chunks)
            assert not any(c.choices[0].delta.tool_calls for c in chunks), choice
            finish = chunks[-1].choices[0].finish_reason
        else:
            out = _ask(client, max_tokens=6, tool_choice=choice).choices[0]
            assert out.message.tool_calls is None, choice
            content, finish = out.message.content, out.finish_reason
        assert finish == "length" and content and content.lstrip()[0] in "{[", (choice, content)


def test_streamed_calls_equal_the_unstreamed(client):
    whole = _ask(client, tool_choice="required", parallel_tool_calls=False)
    whole = whole.choices[0].message.tool_calls
    chunks = list(_ask(client, tool_choice="required", parallel_tool_calls=False, stream=True))
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks)


HERMES_CALL = (r'Checking\. <tool_call>\{"name": "get_time", "arguments": '
               r'\{"zone": "(UTC|CET)"\}\}</tool_call>')


def test_auto_finds_the_calls_the_model_writes(client):
    """tool_choice auto with the hermes parser: the output (steered into Hermes' format by a
    regex) becomes content plus a call, streamed or not; a conversation carrying the call and
    its result goes on."""
    out = _ask(client, tool_choice="auto", extra_body={"guided_regex": HERMES_CALL})
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls" and message.content == "Checking."
    (call,) = message.tool_calls
    assert call.function.name == "get_time"
    _arguments_valid("get_time", call.function.arguments)
    chunks = list(_ask(client, extra_body={"guided_regex": HERMES_CALL}, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    streamed = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert content == "Checking. " and len(streamed) == 1
    assert streamed[0].function.arguments == call.function.arguments
    follow = client.chat.completions.create(
        model="radixlora-demo", max_tokens=8, temperature=0, tools=TOOLS, tool_choice="none",
        messages=[{"role": "user", "content": "time?"}, message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": "12:00"}])
    assert follow.choices[0].message.tool_calls is None


def test_tool_requests_that_cannot_be_served_are_400s(server):
    base = {"model": "radixlora-demo", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4}
    cases = [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice"),
        ({"tools": TOOLS, "tool_choice": 3}, "tool_choice"),
    ]
    for extra, param in cases:
        resp = server.http.post("/v1/chat/completions", json={**base, **extra})
        assert resp.status_code == 400, (extra, resp.text)
        assert resp.json()["error"]["param"] == param, (extra, resp.text)



# ---- LangChain -------------------------------------------------------------------------------


class Fish(pydantic.BaseModel):
    colour: Literal["red", "blue"]
    count: int = pydantic.Field(ge=0, le=99)


def test_langchain_structured_output_and_bound_tools(server):
    """LangChain's ChatOpenAI as agent code uses it: with_structured_output (json_schema and
    function_calling), bind_tools with a named tool and with "any", streamed tool-call chunks,
    and auto calls found by the parser."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_time(zone: Literal["UTC", "CET"]) -> str:
        """The time in a zone."""
        return "12:00"

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model="upper",
                     temperature=0, max_tokens=60, max_retries=0)
    for method in ("json_schema", "function_calling"):
        fish = llm.with_structured_output(Fish, method=method).invoke("a fish, as JSON")
        assert isinstance(fish, Fish), method
    for choice in ("get_time", "any"):
        (call,) = llm.bind_tools([get_time], tool_choice=choice).invoke("time?").tool_calls
        assert call["name"] == "get_time" and call["args"]["zone"] in ("UTC", "CET")
    chunks = [c for c in llm.bind_tools([get_time], tool_choice="any").stream("time?")
              if c.tool_call_chunks]
    (chunk,) = chunks
    assert chunk.tool_call_chunks[0]["name"] == "get_time"
    steered = ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model="reverse",
                         temperature=0, max_tokens=120, max_retries=0,
                         extra_body={"guided_regex": HERMES_CALL})
    message = steered.bind_tools([get_time]).invoke("time?")
    assert message.content == "Checking." and message.tool_calls[0]["name"] == "get_time"
