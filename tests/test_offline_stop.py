"""SamplingParams.stop on the offline Engine: the output ends just before the first stop string
to complete, with the server's semantics (tests/test_cli_compat.py compares the two on the
demo); the request is aborted at the match, so no token is generated past it."""

from __future__ import annotations

import msgspec
import pytest

from radixlora import Engine, InvalidRequestError, SamplingParams
from radixlora.demo import DEMO_ADAPTERS, DEMO_MODEL_DIR, format_prompt
from radixlora.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS

PROMPT = format_prompt("the red fox ate 42 fish")  # base: "the red fox ate 42 fish"


@pytest.fixture(scope="module")
def engine():
    return Engine(DEMO_MODEL_DIR, adapters={"reverse": DEMO_ADAPTERS["reverse"]})


def test_stop_params_are_normalised_and_travel():
    params = SamplingParams(stop="fox", stop_token_ids=[5])
    assert params.stop == ("fox",) and params.stop_token_ids == (5,)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    hash(params)
    wire = msgspec.msgpack.encode(params)
    assert msgspec.msgpack.decode(wire, type=SamplingParams) == params


@pytest.mark.parametrize("stop", [[""], ["x" * (MAX_STOP_CHARS + 1)],
                                  [str(i) for i in range(MAX_STOP_STRINGS + 1)]])
def test_bad_stop_strings_are_rejected(engine, stop):
    with pytest.raises(InvalidRequestError) as e:
        engine.generate(PROMPT, SamplingParams(stop=stop))
    assert e.value.param == "stop"


def test_the_output_ends_before_the_first_stop_and_generation_stops(engine):
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=["ate", "red"])
    base, reverse = engine.generate([PROMPT, PROMPT], params, adapters=[None, "reverse"])
    out = base.outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == ("the ", "stop", "red")
    assert "red" in engine.tokenizer.decode(out.token_ids) and len(out.token_ids) < 6
    out = reverse.outputs[0]  # "fish 42 ate fox red the": "ate" ends first
    assert (out.text, out.finish_reason, out.stop_reason) == ("fish 42 ", "stop", "ate")
    assert engine.scheduler.running == [] and not engine.scheduler.has_work()


def test_samples_stop_independently_and_unmatched_stops_change_nothing(engine):
    plain = engine.generate(PROMPT, SamplingParams(max_tokens=40, temperature=0.0))[0]
    assert plain.outputs[0].text == "the red fox ate 42 fish"
    assert plain.outputs[0].finish_reason == "stop"  # EOS: the token is the stop reason
    assert plain.outputs[0].stop_reason == plain.outputs[0].token_ids[-1]
    unmatched = SamplingParams(max_tokens=40, temperature=0.0, stop=["zebra"])
    same = engine.generate(PROMPT, unmatched)[0].outputs[0]
    assert (same.text, same.token_ids, same.stop_reason) == (
        plain.outputs[0].text, plain.outputs[0].token_ids, plain.outputs[0].stop_reason)
    sampled = SamplingParams(max_tokens=40, temperature=1.0, seed=3, n=4, stop=[" "])
    for sample in engine.generate(PROMPT, sampled)[0].outputs:
        assert " " not in sample.text
        assert sample.finish_reason == "stop"
        assert sample.stop_reason == " " or sample.text == engine.tokenizer.decode(
            sample.token_ids)
