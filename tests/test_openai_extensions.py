"""vLLM's and SGLang's extension fields, as their clients send them to `radixlora serve` (one
server on the tiny model, with a chat template of the test's own): stop strings kept in the
output, special tokens in the text, chat template variables, message names, continuing the
last message, usage in every streamed chunk, the base model when `model` is left out, and
`echo` with prompt logprobs (against transformers)."""

from __future__ import annotations

import json

import openai
import pytest
import torch
import transformers

from radixlora.errors import InvalidRequestError
from radixlora.sched.adapter_choice import check_adapter_name
from radixlora.text.chat import ChatTemplate
from radixlora.text.tokenizer import Tokenizer
from scripts.checkpoints import SPECIALS
from tests.server_harness import MODEL_NAME, build_checkpoints, running_server

PROMPT = "A radix cache shares prefix KV"
TEMPLATE = ("{% for m in messages %}{% if m.name %}{{ m.name }}: {% endif %}{{ m.content }}"
            "{% if not loop.last %} | {% endif %}{% endfor %}"
            "{% if add_generation_prompt %} | A:{% endif %}{% if shout %} LOUDLY{% endif %}")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("extensions")
    model, adapters = build_checkpoints(root)
    template = root / "template.jinja"
    template.write_text(TEMPLATE)
    with running_server(model, adapters, root / "server.log",
                        "--chat-template", str(template)) as proc:
        yield proc, Tokenizer.from_dir(model), ChatTemplate(TEMPLATE), model


@pytest.fixture(scope="module")
def client(setup):
    return openai.OpenAI(base_url=setup[0].url + "/v1", api_key="unused", max_retries=0)


def complete(client, **kwargs) -> str:
    body = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0,
                extra_body={"ignore_eos": True, **kwargs.pop("extra_body", {})}, **kwargs)
    return client.completions.create(**body).choices[0].text


def test_include_stop_str_in_output_and_no_stop_trim(setup, client):
    server = setup[0]
    full = complete(client)
    stop = full[5:8]
    kept = full[: full.index(stop) + len(stop)]
    assert complete(client, stop=[stop]) == full[: full.index(stop)]
    assert complete(client, stop=[stop], extra_body={"include_stop_str_in_output": True}) == kept
    chunks = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16,
                                       temperature=0, stop=[stop], stream=True,
                                       extra_body={"ignore_eos": True,
                                                   "include_stop_str_in_output": True})
    assert "".join(c.choices[0].text for c in chunks) == kept
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 16, "temperature": 0,
                                                "ignore_eos": True, "stop": [stop],
                                                "no_stop_trim": True}}
    assert server.http.post("/generate", json=body).json()["text"] == kept


def test_skip_special_tokens_false_keeps_them_in_the_text(setup):
    """Sampled outputs until one holds a special token: its text with skip_special_tokens
    false is the tokenizer's decode keeping them, and by default the decode without them."""
    server, tokenizer = setup[:2]
    specials = {tokenizer.hf.token_to_id(t) for t in SPECIALS}
    for seed in range(40):
        sampling = {"max_new_tokens": 24, "temperature": 1.0, "ignore_eos": True,
                    "sampling_seed": seed}
        body = {"text": PROMPT, "return_logprob": True, "sampling_params": sampling}
        out = server.http.post("/generate", json=body).json()
        ids = [e[1] for e in out["meta_info"]["output_token_logprobs"]]
        if specials & set(ids):
            break
    else:
        pytest.fail("no sampled output held a special token")
    assert out["text"] == tokenizer.decode(ids, skip_special_tokens=True)
    kept = server.http.post("/generate", json={
        **body, "sampling_params": {**sampling, "skip_special_tokens": False}}).json()
    assert kept["text"] == tokenizer.decode(ids, skip_special_tokens=False) != out["text"]
    chat = server.http.post("/v1/completions", json={
        "model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 24, "temperature": 1.0,
        "seed": seed, "ignore_eos": True, "skip_special_tokens": False}).json()
    assert chat["choices"][0]["text"] == kept["text"]


def prompt_tokens(client, messages, **extra) -> int:
    out = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1,
                                         temperature=0, extra_body=extra or None)
    return out.usage.prompt_tokens


def test_chat_template_kwargs_names_and_continuing_the_last_message(setup, client):
    tokenizer, template = setup[1:3]
    messages = [{"role": "user", "content": "hello there", "name": "bob"},
                {"role": "assistant", "content": "the red fox"}]

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    plain = template.prompt(messages)
    assert plain == "bob: hello there | the red fox | A:"
    assert prompt_tokens(client, messages) == count(plain)
    loud = template.prompt(messages, template_kwargs={"shout": True})
    assert prompt_tokens(client, messages, chat_template_kwargs={"shout": True}) == count(loud)
    assert count(loud) > count(plain)
    open_end = template.prompt(messages, add_generation_prompt=False,
                               continue_final_message=True)
    assert open_end.endswith("the red fox")
    assert prompt_tokens(client, messages, add_generation_prompt=False,
                         continue_final_message=True) == count(open_end)
    assert prompt_tokens(client, messages, continue_final_message=True) == count(open_end)
    with pytest.raises(openai.BadRequestError, match="add_generation_prompt"):
        prompt_tokens(client, messages, add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(openai.BadRequestError, match="may not set messages"):
        prompt_tokens(client, messages, chat_template_kwargs={"messages": []})


def test_continuous_usage_stats_in_every_chunk(client):
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
        temperature=0, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    usages = [c.usage for c in chunks if c.choices]
    assert usages and all(u is not None for u in usages)
    done = [u.completion_tokens for u in usages]
    assert done == sorted(done) and done[-1] == 6 == chunks[-1].usage.completion_tokens


def test_stream_options_without_stream_is_a_400(client):
    with pytest.raises(openai.BadRequestError, match="stream_options"):
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2,
                                  stream_options={"include_usage": True})


def test_the_base_model_without_model_or_as_default(setup, client):
    server = setup[0]
    want = complete(client)
    for model in (None, "default"):
        body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        if model is not None:
            body["model"] = model
        resp = server.http.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == want
        assert resp.json()["model"] == MODEL_NAME  # what served it
    with pytest.raises(InvalidRequestError, match="stands for the base model"):
        check_adapter_name("default")


def test_model_cards_and_server_info(setup):
    server = setup[0]
    cards = server.http.get("/v1/models").json()["data"]
    context = server.http.post("/tokenize", json={"prompt": "x"}).json()["max_model_len"]
    assert len(cards) == 3 and {card["max_model_len"] for card in cards} == {context}
    admin = {"authorization": f"Bearer {server.admin_key}"}
    newer = server.http.get("/server_info", headers=admin)
    assert newer.status_code == 200 and json.loads(newer.text)["served_model_name"] == MODEL_NAME
    assert server.http.get("/server_info").status_code == 401


def reference_logprobs(model_dir, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax over the next token at every prompt position (fp32)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir,
                                                              torch_dtype=torch.float32)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_echo_scores_the_prompt_as_transformers_does(setup, client):
    """lm-eval's loglikelihood request: token ids, echo, logprobs, max_tokens 0."""
    tokenizer, model_dir = setup[1], setup[3]
    ids = tokenizer.encode(PROMPT)
    ref = reference_logprobs(model_dir, ids)
    out = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=0, echo=True,
                                    logprobs=2, temperature=0)
    choice = out.choices[0]
    assert choice.text == tokenizer.decode(ids) and out.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
    want = [ref[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    assert lp.top_logprobs[0] is None
    for i, row in enumerate(lp.top_logprobs[1:], start=1):
        top = ref[i - 1].topk(2).values.tolist()
        assert sorted(row.values(), reverse=True) == pytest.approx(top, abs=1e-4)


def test_echo_with_generated_tokens_and_without_logprobs(client):
    plain = complete(client)
    both = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16,
                                     temperature=0, echo=True, logprobs=0,
                                     extra_body={"ignore_eos": True})
    choice = both.choices[0]
    assert choice.text == PROMPT + plain and both.usage.completion_tokens == 16
    assert len(choice.logprobs.token_logprobs) == both.usage.prompt_tokens + 16
    assert choice.logprobs.text_offset[0] == 0
    only = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=0, echo=True)
    assert only.choices[0].text == PROMPT and only.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=0)


@pytest.mark.parametrize("prompt_ids", [False, True], ids=["text", "token ids"])
@pytest.mark.parametrize("max_tokens, logprobs", [(6, None), (6, 2), (0, 2), (0, None)])
def test_echo_streams_what_it_answers_whole(setup, client, max_tokens, logprobs, prompt_ids):
    """The streamed chunks of an echoed completion add up to the finished response (whose
    prompt logprobs are checked against transformers above): the prompt first, then the
    tokens, the logprobs and offsets in the same order."""
    prompt = setup[1].encode(PROMPT) if prompt_ids else PROMPT
    args = dict(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, echo=True,
                logprobs=logprobs, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**args).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**args, stream=True)
              if c.choices]
    assert "".join(c.text for c in chunks) == whole.text
    assert chunks[0].text.startswith(PROMPT) and chunks[-1].finish_reason == whole.finish_reason
    if logprobs is None:
        assert all(c.logprobs is None for c in chunks)
        return
    for field in ("tokens", "token_logprobs", "text_offset"):
        streamed = [x for c in chunks for x in getattr(c.logprobs, field)]
        assert streamed == pytest.approx(getattr(whole.logprobs, field)), field
    rows = [row for c in chunks for row in c.logprobs.top_logprobs]
    assert len(rows) == len(whole.logprobs.top_logprobs)
    for got, want in zip(rows, whole.logprobs.top_logprobs):
        assert got == want or got == pytest.approx(want, abs=1e-4)


def test_sglang_prompt_top_logprobs_equal_transformers(setup):
    server, tokenizer, model_dir = setup[0], setup[1], setup[3]
    ids = tokenizer.encode(PROMPT)
    ref = reference_logprobs(model_dir, ids)
    body = {"input_ids": ids, "return_logprob": True, "top_logprobs_num": 3,
            "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 0}}
    meta = server.http.post("/generate", json=body).json()["meta_info"]
    rows = meta["input_top_logprobs"]
    assert len(rows) == len(ids) and rows[0] is None
    for i, row in enumerate(rows[1:], start=1):
        top = ref[i - 1].topk(3)
        assert [t for _, t, _ in row] == top.indices.tolist()
        assert [lp for lp, _, _ in row] == pytest.approx(top.values.tolist(), abs=1e-4)
