"""The Responses API (/v1/responses) against the bundled demo server through the official openai
client: plain and streamed answers (the stream's events in the order the SDK assembles, its final
response equal to the unstreamed one), adapters chosen by `model`, a function-tool round trip
continued by previous_response_id and the same conversation sent whole, text.format through
responses.parse, a response cut by max_output_tokens, stored responses read back and deleted,
store: false, and the 400s; then the ResponseStore's bounds on their own."""

from __future__ import annotations

import openai
import pydantic
import pytest

from radixlora.server.http.response_store import ResponseStore
from tests.server_harness import running_server

WORDS = "the red fox ate 42 fish"
TIME = {"type": "function", "name": "get_time", "description": "the time in a zone",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                       "required": ["zone"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(None, {}, tmp_path_factory.mktemp("responses") / "server.log") as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def ask(client, model="upper", **kw):
    return client.responses.create(model=model, input=WORDS, max_output_tokens=40,
                                   temperature=0, **kw)


def test_plain_answers_choose_their_adapter_by_model(client):
    for model, want in (("upper", WORDS.upper()), ("radixlora-demo", WORDS),
                        ("reverse", " ".join(reversed(WORDS.split())))):
        out = ask(client, model)
        assert out.status == "completed" and out.output_text.strip() == want, model
        assert out.id.startswith("resp_") and out.object == "response" and out.model == model
        (item,) = out.output
        assert item.type == "message" and item.role == "assistant" and item.status == "completed"
        assert out.usage.input_tokens > 0 and out.usage.output_tokens > 0
        assert out.usage.total_tokens == out.usage.input_tokens + out.usage.output_tokens
    instructed = client.responses.create(model="upper", instructions="answer in capitals",
                                         input=[{"role": "user", "content": WORDS}],
                                         max_output_tokens=40, temperature=0)
    assert instructed.instructions == "answer in capitals"  # a system message, which the
    assert instructed.output_text.strip() == WORDS.upper()  # demo's template leaves out


def test_the_stream_is_what_the_sdk_assembles(client):
    whole = ask(client)
    with client.responses.stream(model="upper", input=WORDS, max_output_tokens=40,
                                 temperature=0) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert kinds.count("response.output_text.delta") >= 2
    assert final.output_text == whole.output_text and final.status == "completed"
    raw = list(client.responses.create(model="upper", input=WORDS, max_output_tokens=40,
                                       temperature=0, stream=True))
    assert [e.sequence_number for e in raw] == list(range(len(raw)))
    assert "".join(e.delta for e in raw if e.type == "response.output_text.delta") == (
        whole.output_text)


def test_a_function_tool_round_trip(client):
    """tool_choice required gives a function_call; its output sent back, chained by
    previous_response_id, gets a text answer, the same one the conversation sent whole gets."""
    first = client.responses.create(model="radixlora-demo", input="what time is it?",
                                    tools=[TIME], tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=60,
                                    temperature=0)
    (call,) = [o for o in first.output if o.type == "function_call"]
    assert call.name == "get_time" and call.call_id and call.status == "completed"
    assert first.status == "completed"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}
    chained = client.responses.create(model="radixlora-demo", previous_response_id=first.id,
                                      input=[result], tools=[TIME], tool_choice="none",
                                      max_output_tokens=12, temperature=0)
    assert chained.previous_response_id == first.id and chained.status == "completed"
    assert all(o.type == "message" for o in chained.output)
    whole = client.responses.create(
        model="radixlora-demo", tools=[TIME], tool_choice="none", max_output_tokens=12,
        temperature=0, store=False,
        input=[{"role": "user", "content": "what time is it?"},
               call.model_dump(exclude_none=True), result])
    assert whole.output_text == chained.output_text  # the same prompt, token for token
    assert whole.usage.input_tokens == chained.usage.input_tokens
    named = client.responses.create(model="radixlora-demo", input="time?", tools=[TIME],
                                    tool_choice={"type": "function", "name": "get_time"},
                                    max_output_tokens=40, temperature=0)
    assert [o.name for o in named.output] == ["get_time"]


class Words(pydantic.BaseModel):
    words: list[str]


def test_text_format_through_parse(client):
    out = client.responses.parse(model="json", input=WORDS, text_format=Words,
                                 max_output_tokens=60, temperature=0)
    assert out.output_parsed == Words(words=WORDS.split())


def test_a_response_cut_by_max_output_tokens_is_incomplete(client):
    out = client.responses.create(model="upper", input=WORDS, max_output_tokens=2,
                                  temperature=0)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.output_tokens == 2
    with client.responses.stream(model="upper", input=WORDS, max_output_tokens=2,
                                 temperature=0) as stream:
        kinds = [e.type for e in stream]
    assert kinds[-1] == "response.incomplete"


def test_stored_responses_are_read_back_continued_and_deleted(client):
    out = ask(client)
    assert client.responses.retrieve(out.id).output_text == out.output_text
    assert client.responses.delete(out.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(out.id)
    with pytest.raises(openai.NotFoundError, match="previous_response_id|no stored response"):
        client.responses.create(model="upper", input="x", previous_response_id=out.id)
    unstored = ask(client, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"background": True}, "background"),
    ({"include": ["file_search_call.results"]}, "include[0]"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ({"input": ""}, "input"),
])
def test_what_cannot_be_served_is_a_400_naming_the_field(server, body, param):
    resp = server.http.post("/v1/responses", json={"model": "upper", "input": WORDS, **body})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param, resp.text


def test_unknown_fields_are_400s(server):
    resp = server.http.post("/v1/responses", json={"model": "upper", "input": "x", "tempo": 1})
    assert resp.status_code == 400 and "tempo" in resp.json()["error"]["message"]


# ---- the store on its own --------------------------------------------------------------------


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_store_is_bounded_by_age_and_bytes_and_keeps_owners_apart():
    clock = Clock()
    store = ResponseStore(max_bytes=600, ttl_s=10, clock=clock)
    store.put("a", "alice", {"x": "a" * 100}, [])
    store.put("b", "bob", {"x": "b" * 100}, [])
    assert store.get("a", "bob") is None and store.get("a", "alice").response["x"][0] == "a"
    assert not store.delete("a", "bob") and store.get("a", "alice") is not None
    store.put("c", "alice", {"x": "c" * 400}, [])  # over 600 bytes: b, the least recent, goes
    assert store.get("b", "bob") is None and store.get("a", "alice") is not None
    store.put("huge", "alice", {"x": "h" * 700}, [])  # larger than the whole budget: not kept
    assert store.get("huge", "alice") is None and store.get("c", "alice") is not None
    clock.now = 11
    assert store.get("a", "alice") is None and store.get("c", "alice") is None
    assert store.nbytes == 0 and not store.entries and not store.born
