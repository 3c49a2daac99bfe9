"""Request fields against the bundled demo server: every field of OpenAI's completions and chat
specs is honoured or a 400 `unsupported_parameter` naming it, the peers' adapter-choosing fields
(SGLang's `lora_path`, LoRAX's `adapter_id`) choose adapters, and any other field is a 400
`unknown_parameter` listing the names. The demo adapters' outputs are checkable, so a field that
is dropped instead of honoured gives the base model's answer and fails."""

from __future__ import annotations

import json
import re
from typing import Literal

import openai
import pydantic
import pytest

from radixlora.demo import format_prompt
from tests.server_harness import running_server

BASE = "radixlora-demo"
WORDS = "the red fox ate 42 fish"
PROMPT = format_prompt(WORDS)
WANT = {
    None: "the red fox ate 42 fish",
    "upper": "THE RED FOX ATE 42 FISH",
    "reverse": "fish 42 ate fox red the",
    "stack": "FISH 42 ATE FOX RED THE",  # upper + reverse
}
STACK = [{"name": "upper", "weight": 1}, {"name": "reverse", "weight": 1}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(None, {}, tmp_path_factory.mktemp("compat") / "server.log") as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def chat(client, model: str = BASE, **extra) -> str:
    out = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": WORDS}], max_tokens=40,
        temperature=0, extra_body=extra or None)
    return out.choices[0].message.content.strip()


def complete(client, model: str = BASE, prompt=PROMPT, **extra) -> list[str]:
    out = client.completions.create(model=model, prompt=prompt, max_tokens=40, temperature=0,
                                    extra_body=extra or None)
    return [c.text.strip() for c in sorted(out.choices, key=lambda c: c.index)]


def test_adapter_by_model_lora_path_adapter_id_and_stack(client):
    assert chat(client) == WANT[None]
    assert chat(client, "upper") == WANT["upper"]
    assert chat(client, f"{BASE}:reverse") == WANT["reverse"]
    assert chat(client, lora_path="upper") == WANT["upper"]  # SGLang's spelling
    assert chat(client, lora_path=["reverse"]) == WANT["reverse"]
    assert chat(client, "upper", lora_path="upper") == WANT["upper"]  # the same adapter twice
    assert chat(client, adapter_id="reverse") == WANT["reverse"]  # LoRAX's spelling
    assert chat(client, adapters=STACK) == WANT["stack"]
    assert complete(client, lora_path="upper") == [WANT["upper"]]


def test_retrieve_model_cards(client):
    """GET /v1/models/{id}: the base's and an adapter's card as /v1/models lists them; an
    unknown id is a 404 model_not_found."""
    listed = {m.id: m for m in client.models.list().data}
    for name in (BASE, "upper"):
        card = client.models.retrieve(name)
        assert card.id == name and card.model_dump() == listed[name].model_dump()
    assert client.models.retrieve("upper").parent == BASE
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("nope")
    assert err.value.body["code"] == "model_not_found"


def test_lora_path_per_prompt(client):
    got = complete(client, prompt=[PROMPT] * 3, lora_path=["upper", None, "reverse"])
    assert got == [WANT["upper"], WANT[None], WANT["reverse"]]


def error(exc: pytest.ExceptionInfo) -> dict:
    assert exc.value.status_code == 400, exc.value
    return exc.value.body


def test_conflicting_adapter_fields_are_400(client):
    for model, extra, param in [
        ("upper", {"lora_path": "reverse"}, "lora_path"),
        ("upper", {"adapter_id": "reverse"}, "adapter_id"),
        (BASE, {"adapter_id": "upper", "lora_path": ["reverse"]}, "lora_path"),
        (BASE, {"lora_path": "upper", "adapters": STACK}, "adapters"),
        (BASE, {"lora_path": ["upper", "reverse"]}, "lora_path"),  # two for one conversation
    ]:
        with pytest.raises(openai.BadRequestError) as exc:
            chat(client, model, **extra)
        assert error(exc)["param"] == param, (model, extra)
    with pytest.raises(openai.BadRequestError) as exc:
        complete(client, prompt=[PROMPT] * 2, lora_path=["upper"])
    assert error(exc)["param"] == "lora_path"


def test_unknown_fields_are_listed(server):
    body = {"model": BASE, "messages": [{"role": "user", "content": WORDS, "colour": "red"}],
            "lora_paths": "upper", "max_tokens": 4, "stream_options": {"usage": True}}
    resp = server.http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["code"] == "unknown_parameter" and err["type"] == "invalid_request_error"
    for name in ("messages[0].colour", "lora_paths", "stream_options.usage"):
        assert name in err["message"]
    generate = {"text": PROMPT, "sampling_params": {"max_new_tokens": 4, "top_n": 3},
                "lora": "upper"}
    err = server.http.post("/generate", json=generate).json()["error"]
    assert err["code"] == "unknown_parameter"
    assert "sampling_params.top_n" in err["message"] and "lora" in err["message"]


UNSUPPORTED_CHAT = [
    ("functions", [{"name": "f"}]),
    ("function_call", "auto"),
    ("response_format", {"type": "structural_tag"}),
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("modalities", ["text", "audio"]),
    ("metadata", {"k": "v"}),
    ("moderation", {"model": "omni-moderation-latest"}),
    ("prediction", {"type": "content", "content": "x"}),
    ("prompt_cache_options", {"mode": "explicit"}),
    ("prompt_cache_retention", "24h"),
    ("reasoning_effort", "high"),
    ("service_tier", "flex"),
    ("store", True),
    ("verbosity", "low"),
    ("web_search_options", {}),
]


@pytest.mark.parametrize("field,value", UNSUPPORTED_CHAT, ids=[f for f, _ in UNSUPPORTED_CHAT])
def test_unsupported_chat_fields_are_named(server, field, value):
    body = {"model": BASE, "messages": [{"role": "user", "content": WORDS}], "max_tokens": 4,
            field: value}
    resp = server.http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert (err["code"], err["param"]) == ("unsupported_parameter", field)


def test_unsupported_message_and_completion_fields_are_named(server):
    cases = [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": WORDS,
                                                "function_call": {"name": "f"}}]},
         "messages[0].function_call"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:,"}}]}]}, "messages[0].content"),
        ("/v1/completions", {"prompt": PROMPT, "suffix": "x"}, "suffix"),
        ("/v1/completions", {"prompt": PROMPT, "best_of": 3}, "best_of"),
        ("/generate", {"text": PROMPT, "sampling_params": {"stop_regex": "a+"}}, "stop_regex"),
        ("/generate", {"text": PROMPT, "image_data": "x.png"}, "image_data"),
        ("/generate", {"text": PROMPT, "token_ids_logprob": [1, 2]}, "token_ids_logprob"),
        ("/generate", {"text": PROMPT, "log_metrics": False}, "log_metrics"),
    ]
    for path, body, param in cases:
        if path != "/generate":
            body = {"model": BASE, "max_tokens": 4, **body}
        resp = server.http.post(path, json=body)
        assert resp.status_code == 400, (path, body, resp.text)
        err = resp.json()["error"]
        assert (err["code"], err["param"]) == ("unsupported_parameter", param), body


def test_neutral_values_of_unsupported_fields_are_accepted(client):
    """What OpenAI's SDKs and frameworks send by default asks for nothing radixlora lacks."""
    out = client.chat.completions.create(
        model="upper", messages=[{"role": "user", "content": [{"type": "text", "text": WORDS}]}],
        max_completion_tokens=40, temperature=0, top_p=1, n=1, presence_penalty=0,
        frequency_penalty=0, logit_bias={}, tools=[], tool_choice="none", store=False,
        response_format={"type": "text"}, modalities=["text"], service_tier="auto",
        parallel_tool_calls=False, user="u", safety_identifier="s", prompt_cache_key="k",
        reasoning_effort="none", seed=1, metadata={})
    assert out.choices[0].message.content.strip() == WANT["upper"]


def test_streaming_usage_and_obfuscation(client, server):
    stream = client.chat.completions.create(
        model=BASE, messages=[{"role": "user", "content": WORDS}], max_tokens=40, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"lora_path": "reverse"})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip() == WANT["reverse"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    body = {"model": BASE, "prompt": PROMPT, "max_tokens": 8, "stream": True,
            "stream_options": {"include_obfuscation": True}}
    with server.http.stream("POST", "/v1/completions", json=body) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines()
                  if line.startswith("data: {")]
    assert events and all(
        (len(e["choices"][0]["text"]) + len(e["obfuscation"])) % 64 in range(1, 16)
        for e in events)


def test_generate_lora_path_and_logprob_options(server):
    body = {"text": [PROMPT, PROMPT], "lora_path": ["upper", None],
            "sampling_params": {"max_new_tokens": 40, "temperature": 0, "n": None},
            "return_logprob": [True, False], "top_logprobs_num": [2, 0],
            "return_text_in_logprobs": True}
    outs = server.http.post("/generate", json=body).json()
    assert [o["text"].strip() for o in outs] == [WANT["upper"], WANT[None]]
    meta = outs[0]["meta_info"]
    assert meta["input_token_logprobs"] == []  # logprob_start_len -1: no prompt token
    entries = meta["output_token_logprobs"]
    assert len(entries) == meta["completion_tokens"]
    assert "".join(text for _, _, text in entries).strip() == WANT["upper"] + "</s>"  # eos
    assert all(len(row) == 2 and all(isinstance(t, str) for _, _, t in row)
               for row in meta["output_top_logprobs"])
    assert "output_token_logprobs" not in outs[1]["meta_info"]
    scored = {"text": PROMPT, "sampling_params": {"max_new_tokens": 0},
              "return_logprob": True, "logprob_start_len": 0}
    plain = server.http.post("/generate", json=scored).json()["meta_info"]
    texts = server.http.post("/generate", json={**scored, "return_text_in_logprobs": True})
    named = texts.json()["meta_info"]
    assert len(named["input_token_logprobs"]) == named["prompt_tokens"]
    assert named["input_token_logprobs"][0][0] is None  # position 0 has no context
    assert "".join(t for _, _, t in named["input_token_logprobs"]) == PROMPT
    assert [e[:2] for e in plain["input_token_logprobs"]] == [
        e[:2] for e in named["input_token_logprobs"]]
    assert all(e[2] is None for e in plain["input_token_logprobs"])


def test_batch_files_take_the_same_fields(tmp_path):
    """`radixlora batch` validates bodies with the server's schemas: lora_path and adapter_id
    choose adapters there too, and an unknown field fails its line."""
    from radixlora import Engine
    from radixlora.cli.run_batch import run_batch
    from radixlora.demo import DEMO_ADAPTERS, DEMO_MODEL_DIR

    bodies = {
        "per-prompt": ("/v1/completions", {"prompt": [PROMPT, PROMPT], "lora_path": [
            "reverse", None]}),
        "lorax": ("/v1/chat/completions", {"messages": [{"role": "user", "content": WORDS}],
                                           "adapter_id": "upper"}),
        "typo": ("/v1/completions", {"prompt": PROMPT, "lora_paths": "upper"}),
    }
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"custom_id": k, "method": "POST", "url": url, "body": {
        "model": BASE, "max_tokens": 40, "temperature": 0, **body}}) + "\n"
        for k, (url, body) in bodies.items()))
    engine = Engine(DEMO_MODEL_DIR, adapters=DEMO_ADAPTERS)
    run_batch(src, out, engine, progress=False, model_name=BASE)
    records = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    texts = [c["text"].strip() for c in records["per-prompt"]["response"]["body"]["choices"]]
    assert texts == [WANT["reverse"], WANT[None]]
    message = records["lorax"]["response"]["body"]["choices"][0]["message"]["content"]
    assert message.strip() == WANT["upper"]
    assert "lora_paths" in records["typo"]["error"]["message"]


def test_unknown_names_say_what_is_served_and_name_the_right_field(server):
    """An unknown adapter is a 404 naming the field that named it and listing what is served;
    each error is counted once in radixlora_request_errors_total."""
    def errors() -> float:
        text = server.http.get("/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith('radixlora_request_errors_total{code="adapter_not_found"'))

    before = errors()
    cases = [
        ("/v1/completions", {"model": "gpt-4", "prompt": PROMPT, "max_tokens": 2}, "model"),
        ("/v1/completions", {"model": BASE, "prompt": PROMPT, "max_tokens": 2,
                             "adapters": [{"name": "upper"}, {"name": "nope"}]}, "adapters"),
        ("/v1/chat/completions", {"model": BASE, "max_tokens": 2, "lora_path": "nope",
                                  "messages": [{"role": "user", "content": WORDS}]},
         "lora_path"),
        ("/generate", {"text": PROMPT, "lora_path": "nope",
                       "sampling_params": {"max_new_tokens": 2}}, "lora_path"),
    ]
    for path, body, param in cases:
        resp = server.http.post(path, json=body)
        assert resp.status_code == 404, resp.text
        err = resp.json()["error"]
        assert (err["code"], err["param"]) == ("adapter_not_found", param), body
        assert f"base model {BASE!r}" in err["message"] and "upper" in err["message"]
    assert errors() - before == len(cases)


# ---- structured output -----------------------------------------------------------------------


class Fish(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    colour: Literal["red", "blue"]
    count: int = pydantic.Field(ge=0, le=99)
    tags: list[Literal["a", "b"]] = pydantic.Field(max_length=2)


ADAPTERS = (BASE, "upper", "reverse", "digits", "json")


@pytest.mark.parametrize("model", ADAPTERS)
def test_json_schema_output_validates_for_every_demo_adapter(client, model):
    """The openai SDK's parse() (as LangChain's with_structured_output sends it): strict
    json_schema from a pydantic model; the content validates, on the base and each adapter."""
    out = client.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": WORDS}], max_tokens=60,
        temperature=0, response_format=Fish)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "stop", message.content
    assert isinstance(message.parsed, Fish)
    Fish.model_validate_json(message.content)


def test_every_structured_output_field_constrains_the_output(client, server):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
              "required": ["ok"], "additionalProperties": False}
    # the json adapter writes JSON as json.dumps does, so the constraint leaves its answer be
    text = chat(client, "json", response_format={"type": "json_object"})
    assert json.loads(text) == {"words": WORDS.split()}
    for extra in ({"guided_json": schema}, {"structured_outputs": {"json": schema}}):
        assert json.loads(complete(client, "reverse", **extra)[0]).keys() == {"ok"}
    for extra in ({"guided_regex": "[0-9]{3}-[a-z]{2}"}, {"regex": "[0-9]{3}-[a-z]{2}"},
                  {"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}):
        assert re.fullmatch("[0-9]{3}-[a-z]{2}", chat(client, **extra)), extra
    for extra in ({"guided_choice": ["fox", "fish"]},
                  {"structured_outputs": {"choice": ["fox", "fish"]}}):
        assert complete(client, "digits", **extra)[0] in ("fox", "fish")
    grammar = 'root ::= "yes" | "no"'
    assert chat(client, ebnf=grammar) in ("yes", "no")
    assert chat(client, guided_grammar=grammar) in ("yes", "no")
    for sampling in ({"regex": "[A-Z]{4}"}, {"json_schema": json.dumps(schema)},
                     {"ebnf": grammar}):
        body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 30, "temperature": 0,
                                                    **sampling}}
        out = server.http.post("/generate", json=body).json()["text"]
        if "regex" in sampling:
            assert re.fullmatch("[A-Z]{4}", out), out
        elif "json_schema" in sampling:
            assert json.loads(out).keys() == {"ok"}
        else:
            assert out in ("yes", "no")


def test_bad_structured_output_requests_name_their_field(server):
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
         "response_format"),
        ({"guided_regex": "a(b"}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"regex": "a+", "guided_json": {"type": "object"}}, "regex"),
        ({"ebnf": "root ::= ("}, "ebnf"),
    ]
    for extra, param in cases:
        body = {"model": BASE, "messages": [{"role": "user", "content": WORDS}],
                "max_tokens": 4, **extra}
        resp = server.http.post("/v1/chat/completions", json=body)
        assert resp.status_code == 400, (extra, resp.text)
        assert resp.json()["error"]["param"] == param, (extra, resp.text)
    body = {"text": PROMPT, "sampling_params": {"regex": "a(", "max_new_tokens": 4}}
    resp = server.http.post("/generate", json=body)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "sampling_params.regex"


def test_tools_with_auto_choice_need_no_launch_flag(server):
    """This server has no --tool-call-parser: the demo's chat template writes calls in Hermes'
    format, so tool_choice auto (the default with tools) parses them; /server_info says where
    the parser came from. Without a call the answer is the content."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = {"model": BASE, "messages": [{"role": "user", "content": WORDS}], "max_tokens": 40,
            "temperature": 0, "tools": tools}
    assert server.info()["tool_call_parser"] == {"name": "hermes", "source": "chat template"}
    for choice in (None, "auto", "none"):
        resp = server.http.post("/v1/chat/completions",
                                json={**body, **({"tool_choice": choice} if choice else {})})
        message = resp.json()["choices"][0]["message"]
        assert message["content"].strip() == WANT[None] and not message.get("tool_calls")
    steered = {**body, "guided_regex": r'<tool_call>\{"name": "f", "arguments": \{\}\}</tool_call>'}
    out = server.http.post("/v1/chat/completions", json=steered).json()["choices"][0]
    assert out["finish_reason"] == "tool_calls" and out["message"]["content"] is None
    assert [c["function"] for c in out["message"]["tool_calls"]] == [
        {"name": "f", "arguments": "{}"}]


def test_bad_words_are_never_written(client):
    """vLLM's bad_words through the openai SDK: the upper adapter's answer loses the word."""
    assert "FOX" in chat(client, "upper")
    text = chat(client, "upper", bad_words=["FOX"])
    assert "FOX" not in text and text.startswith("THE RED")


def test_return_tokens_as_token_ids(client):
    """vLLM's return_tokens_as_token_ids: every logprob entry's token is "token_id:N", N the
    token whose text the same request without it shows, top alternatives and echo included."""
    from tokenizers import Tokenizer

    from radixlora.demo import DEMO_MODEL_DIR

    tokenizer = Tokenizer.from_file(str(DEMO_MODEL_DIR / "tokenizer.json"))
    kw = dict(model="upper", max_tokens=6, temperature=0)
    messages = [{"role": "user", "content": WORDS}]
    texts = client.chat.completions.create(messages=messages, logprobs=True, top_logprobs=2, **kw)
    ids = client.chat.completions.create(messages=messages, logprobs=True, top_logprobs=2,
                                         extra_body={"return_tokens_as_token_ids": True}, **kw)
    for plain, as_id in zip(texts.choices[0].logprobs.content, ids.choices[0].logprobs.content,
                            strict=True):
        assert re.fullmatch(r"token_id:\d+", as_id.token) and as_id.logprob == plain.logprob
        assert tokenizer.decode([int(as_id.token[9:])], skip_special_tokens=False) == plain.token
        assert [tokenizer.decode([int(t.token[9:])], skip_special_tokens=False)
                for t in as_id.top_logprobs] == [t.token for t in plain.top_logprobs]
    echoed = client.completions.create(prompt=PROMPT, logprobs=1, echo=True, **kw,
                                       extra_body={"return_tokens_as_token_ids": True})
    tokens = echoed.choices[0].logprobs.tokens
    assert all(re.fullmatch(r"token_id:\d+", t) for t in tokens)
    assert [int(t[9:]) for t in tokens[:-6]] == tokenizer.encode(PROMPT).ids
