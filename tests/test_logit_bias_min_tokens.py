"""What changes the logits before sampling: OpenAI's logit_bias, presence and frequency
penalties, vLLM's min_tokens and repetition_penalty (SGLang's min_new_tokens and penalties).
The Engine's greedy tokens and raw logprobs against transformers' generate with its own
SequenceBias and MinNewTokensLength processors, penalties against greedy decoding on
transformers' logits with its RepetitionPenalty processor (overlap scheduling on and off),
stop strings held until min_tokens, the HTTP fields, and their validation."""

from __future__ import annotations

import openai
import pytest
import torch

from radixlora import Engine, SamplingParams
from radixlora.errors import InvalidRequestError
from radixlora.text.detokenize import StopMatcher
from tests.oracle import hf_model
from tests.server_harness import MODEL_NAME, build_checkpoints, running_server

PROMPT_IDS = [5, 17, 42, 8, 99, 23, 61, 4]
NEW = 10


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    model, _ = build_checkpoints(tmp_path_factory.mktemp("bias"))
    return model


@pytest.fixture(scope="module")
def engine(model_dir):
    return Engine(model_dir, dtype="float32")


@pytest.fixture(scope="module")
def hf(model_dir):
    return hf_model(model_dir)


def hf_greedy(hf, bias: dict[int, float] | None = None, min_new: int = 0,
              eos: int | None = None) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and their logprobs under the raw model distribution."""
    kwargs = {"sequence_bias": {(t,): b for t, b in bias.items()}} if bias else {}
    if min_new:
        kwargs["min_new_tokens"] = min_new
    out = hf.generate(torch.tensor([PROMPT_IDS]), max_new_tokens=NEW, do_sample=False,
                      eos_token_id=eos if eos is not None else -1, pad_token_id=0,
                      return_dict_in_generate=True, output_logits=True, **kwargs)
    tokens = out.sequences[0, len(PROMPT_IDS):].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item()
                for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


def run(engine, **params):
    out = engine.generate(PROMPT_IDS, SamplingParams(max_tokens=NEW, temperature=0.0,
                                                     logprobs=0, **params))
    return out[0].outputs[0]


def test_logit_bias_matches_transformers_and_logprobs_stay_raw(engine, hf):
    base, _ = hf_greedy(hf)
    assert run(engine, ignore_eos=True).token_ids == base
    # push the base's second and third tokens down and two others up, so that the path changes
    bias = {base[1]: -4.0, base[2]: -2.5, 7: 3.0, 11: 2.0}
    want, want_lp = hf_greedy(hf, bias)
    assert want != base
    got = run(engine, ignore_eos=True, logit_bias=bias)
    assert got.token_ids == want
    assert got.logprobs == pytest.approx(want_lp, abs=1e-4)


def test_min_tokens_holds_stop_tokens_back_as_transformers_does(engine, hf):
    base, _ = hf_greedy(hf)
    stop = base[2]  # greedy would stop at the third token
    early = run(engine, stop_token_ids=(stop,), ignore_eos=True)
    assert early.token_ids == base[:3] and early.finish_reason == "stop"
    want, want_lp = hf_greedy(hf, min_new=6, eos=stop)
    got = run(engine, stop_token_ids=(stop,), ignore_eos=True, min_tokens=6)
    assert len(got.token_ids) >= 6
    assert got.token_ids == want[: len(got.token_ids)]
    assert got.logprobs == pytest.approx(want_lp[: len(got.token_ids)], abs=1e-4)
    if got.finish_reason == "stop":
        assert got.token_ids[-1] == stop


class Letters:
    """An IncrementalDecoder stand-in: token k is the k-th letter."""

    def push(self, ids):
        return "".join(chr(ord("a") + i) for i in ids)


def test_stop_string_ending_before_min_tokens_does_not_count():
    """Tokens are letters: a stop string counts once it ends in the text of token min_tokens
    or later, however the tokens are grouped."""
    plain = StopMatcher(["bc"])
    assert (plain.feed_tokens(Letters(), [0, 1, 2]), plain.matched) == ("a", "bc")
    held = StopMatcher(["bc"], min_tokens=4)  # "bc" ends in the third token's text
    assert held.feed_tokens(Letters(), [0, 1, 2]) + held.flush() == "abc"
    assert held.matched is None
    late = StopMatcher(["ab"], min_tokens=3)
    text = late.feed_tokens(Letters(), [0, 1]) + late.feed_tokens(Letters(), [2, 0, 1, 3])
    assert (text, late.matched) == ("abc", "ab")
    ends_at_min = StopMatcher(["bc"], min_tokens=3)  # ends in the third token's text: counts
    text = ends_at_min.feed_tokens(Letters(), [0]) + ends_at_min.feed_tokens(Letters(), [1, 2])
    assert (text, ends_at_min.matched) == ("a", "bc")


def test_validation(engine):
    cases = [
        (SamplingParams(logit_bias={10**7: 1.0}), "logit_bias"),
        (SamplingParams(logit_bias={3: 101.0}), "logit_bias"),
        (SamplingParams(logit_bias={3: float("nan")}), "logit_bias"),
        (SamplingParams(max_tokens=4, min_tokens=5), "min_tokens"),
        (SamplingParams(min_tokens=-1), "min_tokens"),
        (SamplingParams(presence_penalty=2.5), "presence_penalty"),
        (SamplingParams(frequency_penalty=-3.0), "frequency_penalty"),
        (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
    ]
    for params, param in cases:
        with pytest.raises(InvalidRequestError) as e:
            engine.generate(PROMPT_IDS, params)
        assert e.value.param == param
    with pytest.raises(InvalidRequestError, match="maps token ids"):
        SamplingParams(logit_bias=5)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with running_server(model_dir, {}, tmp_path_factory.mktemp("srv") / "server.log") as proc:
        yield proc


def test_http_fields_match_the_engine(server, engine):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    base = run(engine, ignore_eos=True).token_ids
    bias = {base[1]: -4.0, 7: 3.0}
    want = run(engine, ignore_eos=True, logit_bias=bias)
    got = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT_IDS, max_tokens=NEW, temperature=0,
        logit_bias={str(t): b for t, b in bias.items()}, logprobs=0,
        extra_body={"ignore_eos": True})
    assert got.choices[0].logprobs.token_logprobs == pytest.approx(want.logprobs, abs=1e-4)
    stop = base[2]
    want = run(engine, stop_token_ids=(stop,), ignore_eos=True, min_tokens=6)
    sgl = server.http.post("/generate", json={
        "input_ids": PROMPT_IDS, "return_logprob": True,
        "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True,
                            "stop_token_ids": [stop], "min_new_tokens": 6}}).json()
    assert [e[1] for e in sgl["meta_info"]["output_token_logprobs"]] == want.token_ids
    open_ended = server.http.post("/generate", json={  # max_new_tokens: what the context leaves
        "input_ids": PROMPT_IDS, "sampling_params": {"temperature": 0, "min_new_tokens": 5,
                                                     "stop_token_ids": [stop]}})
    assert open_ended.status_code == 200, open_ended.text
    assert open_ended.json()["meta_info"]["completion_tokens"] >= 5
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=NEW,
        temperature=0, extra_body={"min_tokens": NEW, "ignore_eos": False})
    assert chat.usage.completion_tokens == NEW


def test_http_validation(server):
    cases = [
        ("/v1/completions", {"logit_bias": {"x": 1}}, "logit_bias"),
        ("/v1/completions", {"logit_bias": {"5": 500}}, "logit_bias"),
        ("/v1/completions", {"min_tokens": 99, "max_tokens": 4}, "min_tokens"),
        ("/v1/completions", {"repetition_penalty": -1}, "repetition_penalty"),
        ("/v1/completions", {"presence_penalty": 3}, "presence_penalty"),
    ]
    for path, extra, param in cases:
        body = {"model": MODEL_NAME, "prompt": "a", "max_tokens": 4, **extra}
        resp = server.http.post(path, json=body)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == param
    ok = server.http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "a",
                                                    "max_tokens": 2, "repetition_penalty": 1.0})
    assert ok.status_code == 200, ok.text


def test_penalties_over_http_match_the_engine(server, engine):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    want = run(engine, ignore_eos=True, presence_penalty=-2.0, frequency_penalty=0.5)
    got = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT_IDS, max_tokens=NEW, temperature=0, logprobs=0,
        presence_penalty=-2.0, frequency_penalty=0.5, extra_body={"ignore_eos": True})
    assert got.choices[0].logprobs.token_logprobs == pytest.approx(want.logprobs, abs=1e-4)
    want = run(engine, ignore_eos=True, repetition_penalty=1.5)
    sgl = server.http.post("/generate", json={
        "input_ids": PROMPT_IDS, "return_logprob": True,
        "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True,
                            "repetition_penalty": 1.5}}).json()
    assert [e[1] for e in sgl["meta_info"]["output_token_logprobs"]] == want.token_ids


@torch.no_grad()
def reference_greedy(hf, presence=0.0, frequency=0.0, repetition=1.0,
                     bias: dict[int, float] | None = None) -> tuple[list[int], list[float]]:
    """Greedy decoding on transformers' logits: logit_bias added, then OpenAI's presence and
    frequency penalties over the output so far, then transformers' own repetition penalty
    processor over prompt and output (vLLM's order); logprobs of the raw logits."""
    from transformers import RepetitionPenaltyLogitsProcessor

    out, logprobs = [], []
    for _ in range(NEW):
        ids = torch.tensor([PROMPT_IDS + out])
        raw = hf(ids).logits[0, -1].float()
        x = raw.clone()
        for token, b in (bias or {}).items():
            x[token] += b
        counts = torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=len(x)).float()
        x -= frequency * counts + presence * (counts > 0).float()
        if repetition != 1.0:
            x = RepetitionPenaltyLogitsProcessor(repetition)(ids, x[None])[0]
        token = int(x.argmax())
        out.append(token)
        logprobs.append(torch.log_softmax(raw, -1)[token].item())
    return out, logprobs


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("penalties", [
    {"presence_penalty": -2.0}, {"frequency_penalty": -1.5}, {"repetition_penalty": 1.8},
    {"presence_penalty": 1.5, "repetition_penalty": 0.6},
    {"presence_penalty": -0.5, "frequency_penalty": 1.2, "repetition_penalty": 0.6},
], ids=["presence", "frequency", "repetition", "presence+repetition", "all"])
def test_penalties_match_a_reference_on_transformers_logits(model_dir, hf, penalties, overlap):
    engine = Engine(model_dir, dtype="float32", overlap_schedule=overlap)
    want, want_lp = reference_greedy(hf, penalties.get("presence_penalty", 0.0),
                                     penalties.get("frequency_penalty", 0.0),
                                     penalties.get("repetition_penalty", 1.0))
    assert want != hf_greedy(hf)[0]  # the penalties change the path
    got = run(engine, ignore_eos=True, **penalties)
    assert got.token_ids == want
    assert got.logprobs == pytest.approx(want_lp, abs=1e-4)


def test_penalties_with_logit_bias_in_a_batch_beside_plain_requests(engine, hf):
    """One step holds a penalized request, a biased one and a plain one; each gets its own."""
    bias = {7: 2.0}
    params = [SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, **extra)
              for extra in ({"frequency_penalty": -1.5, "logit_bias": bias},
                            {"logit_bias": bias}, {})]
    outs = engine.generate([PROMPT_IDS] * 3, params)
    assert outs[0].outputs[0].token_ids == reference_greedy(hf, frequency=-1.5, bias=bias)[0]
    assert outs[1].outputs[0].token_ids == hf_greedy(hf, bias)[0]
    assert outs[2].outputs[0].token_ids == hf_greedy(hf)[0]
