"""Head-of-line blocking in the tokenizer process: a prompt that cannot fit in the context is
rejected from its size alone, before any tokenization; long prompts tokenize on the pool's
threads while short ones are answered; an abort that arrives while its request is being
tokenized is held and applied when tokenization ends, never lost and never ahead of it."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer

from radixlora.demo import DEMO_MODEL_DIR
from radixlora.errors import InvalidRequestError
from radixlora.sampling_params import SamplingParams
from radixlora.server.args import ServerArgs
from radixlora.server.messages import (
    AbortReq,
    ChatMessage,
    GenerateReq,
    ReqError,
    TokenizedReq,
    bytes_to_ids,
)
from radixlora.server.procs import tokenizer_proc
from radixlora.server.procs.tokenizer_proc import TokenizerService
from radixlora.text.tokenizer import UNICODE_SHRINK, Tokenizer
from tests.server_harness import running_server, sized

DEMO_SPEC = json.loads((DEMO_MODEL_DIR / "tokenizer.json").read_text())
DEMO_TOKENIZER = Tokenizer.from_dir(DEMO_MODEL_DIR)
DEMO_PIECES = [DEMO_TOKENIZER.decode([i]) for i in range(DEMO_TOKENIZER.vocab_size)]
BIG_PROMPT_BYTES = 3 * 1024 * 1024
NORMAL_REQUEST_S = 5  # a normal request alone: well under 1 s; behind the big prompts: 15 s


@pytest.fixture(scope="module")
def service() -> TokenizerService:
    return TokenizerService(sized(ServerArgs(model=str(DEMO_MODEL_DIR))))


def generate(rid: str, prompt: str | None = None, n: int = 1, **extra) -> GenerateReq:
    return GenerateReq(rid=rid, params=SamplingParams(max_tokens=4, n=n), prompt=prompt, **extra)


def tokenizer_with(**changes) -> Tokenizer:
    return Tokenizer(HFTokenizer.from_str(json.dumps({**DEMO_SPEC, **changes})))


# ---- the byte cap ------------------------------------------------------------------------------


def test_too_long_prompts_are_rejected_without_tokenization(service, monkeypatch):
    def encode(*_args, **_kwargs):
        raise AssertionError("a prompt over the byte cap was tokenized")

    monkeypatch.setattr(service.tokenizer, "encode", encode)
    monkeypatch.setattr(service.tokenizer, "encode_unlocked", encode)
    text = "x" * (prompt_cap(service) + 1)
    chat = [ChatMessage(role="user", content=text)]
    for req in (generate("p", text), generate("c", messages=chat),
                generate("only", text, prompt_only=True)):
        to_sched, to_api = service.on_generate(req)
        assert to_sched == [] and len(to_api) == 1
        assert isinstance(to_api[0], ReqError) and to_api[0].code == "context_length_exceeded"
    assert not service.reqs and not service.pending


def test_the_cap_is_the_context_times_the_longest_token(service):
    vocab = service.tokenizer.hf.get_vocab(with_added_tokens=True)
    assert service.tokenizer.max_bytes_per_token == max(len(token.encode()) for token in vocab)
    cap = prompt_cap(service)
    service.tokenizer.check_fits("x" * cap, service.max_total)
    with pytest.raises(InvalidRequestError, match="cannot fit"):
        service.tokenizer.check_fits("x" * (cap + 1), service.max_total)


def prompt_cap(service) -> int:
    """Bytes of the longest prompt the tokenizer service takes untokenized."""
    return service.max_total * service.tokenizer.max_bytes_per_token


texts = st.lists(st.sampled_from(DEMO_PIECES) | st.text(max_size=8), max_size=400).map("".join)


@settings(max_examples=200, deadline=None)
@given(texts)
def test_the_cap_never_rejects_a_prompt_that_fits(service, text):
    tokens = len(service.tokenizer.encode(text))
    assert len(text.encode()) <= tokens * service.tokenizer.max_bytes_per_token
    if tokens <= service.max_total:
        service.check_bytes(text, "prompt")


NFKC = tokenizer_with(normalizer={"type": "NFKC"})
compatibility_texts = st.lists(
    st.sampled_from(["\U0001d400", "\uff21", "\u212b", "e\u0301", "\u1100\u1161\u11a8", "ﬃ"])
    | st.text(max_size=4), max_size=200,
).map("".join)


@settings(max_examples=100, deadline=None)
@given(compatibility_texts)
def test_a_normalizer_that_shrinks_text_widens_the_bound(text):
    assert NFKC.max_bytes_per_token == UNICODE_SHRINK * DEMO_TOKENIZER.max_bytes_per_token
    assert len(text.encode()) <= len(NFKC.encode(text)) * NFKC.max_bytes_per_token


@pytest.mark.parametrize("changes", [
    {"normalizer": {"type": "Strip", "strip_left": True, "strip_right": True}},
    {"pre_tokenizer": {"type": "WhitespaceSplit"}},
    {"truncation": {"direction": "Right", "max_length": 8, "strategy": "LongestFirst",
                    "stride": 0}},
    {"added_tokens": [{**DEMO_SPEC["added_tokens"][0], "lstrip": True}]},
])
def test_no_cap_where_text_may_vanish_into_no_token(changes):
    assert tokenizer_with(**changes).max_bytes_per_token is None


# ---- the pool and aborts ---------------------------------------------------------------------


class Gate:
    """encode_unlocked held until released; sends collected."""

    def __init__(self, service: TokenizerService, monkeypatch):
        self.service = service
        self.open = threading.Event()
        self.sent = []
        real = service.tokenizer.encode_unlocked

        def encode(text, add_special_tokens=True):
            if len(text) > tokenizer_proc.INLINE_PROMPT_CHARS:
                assert self.open.wait(10)
            return real(text, add_special_tokens)

        monkeypatch.setattr(service.tokenizer, "encode_unlocked", encode)
        monkeypatch.setattr(tokenizer_proc, "INLINE_PROMPT_CHARS", 10)

    def send(self, to_sched: list, to_api: list) -> None:
        self.sent.append((to_sched, to_api))

    def release_and_wait(self) -> None:
        """Let tokenization go on, and wait until every pool result was delivered."""
        self.open.set()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with self.service.lock:
                if not self.service.pending:
                    return
            time.sleep(0.01)
        raise TimeoutError("the pool did not deliver")


@pytest.fixture
def pooled(monkeypatch):
    service = TokenizerService(sized(ServerArgs(model=str(DEMO_MODEL_DIR))))
    gate = Gate(service, monkeypatch)
    service.start_pool(gate.send)
    return service, gate


LONG = "the quick brown fox jumps over the lazy dog"


def test_short_prompts_are_answered_while_a_long_one_tokenizes(pooled):
    service, gate = pooled
    assert service.on_generate(generate("long", LONG)) == ([], [])
    to_sched, to_api = service.on_generate(generate("short", "hi"))
    assert [m.rid for m in to_sched] == ["short"] and to_api == []
    assert gate.sent == []
    gate.release_and_wait()
    [(to_sched, to_api)] = gate.sent
    assert [m.rid for m in to_sched] == ["long"] and to_api == []
    assert "long" in service.reqs and not service.pending


def test_a_long_prompt_over_the_cap_is_rejected_before_the_pool(pooled):
    service, gate = pooled
    to_sched, [error] = service.on_generate(generate("big", "x" * (prompt_cap(service) + 1)))
    assert to_sched == [] and error.code == "context_length_exceeded"
    assert not service.pending and gate.sent == []


def test_pool_and_loop_give_the_same_tokens(pooled, service):
    pool_service, gate = pooled
    pool_service.on_generate(generate("a", LONG))
    gate.release_and_wait()
    [([pooled_req], _)] = gate.sent
    [inline_req], _ = service.on_generate(generate("a", LONG))
    assert isinstance(pooled_req, TokenizedReq)
    assert pooled_req.input_ids == inline_req.input_ids
    assert bytes_to_ids(pooled_req.input_ids).tolist() == service.tokenizer.encode(LONG)
    service.on_abort(AbortReq(rid="a"))


def test_an_abort_during_tokenization_drops_the_request(pooled):
    service, gate = pooled
    service.on_generate(generate("r", LONG))
    assert service.on_abort(AbortReq(rid="r")) == []
    gate.release_and_wait()
    assert gate.sent == []
    assert "r" not in service.reqs and not service.pending
    assert service.on_abort(AbortReq(rid="r")) == [AbortReq(rid="r")]


def test_a_sample_abort_during_tokenization_follows_its_request(pooled):
    service, gate = pooled
    service.on_generate(generate("r", LONG, n=2))
    assert service.on_abort(AbortReq(rid="r", index=0)) == []
    gate.release_and_wait()
    [(to_sched, to_api)] = gate.sent
    assert isinstance(to_sched[0], TokenizedReq) and to_sched[1:] == [AbortReq(rid="r", index=0)]
    assert service.reqs["r"].done == {0}


def test_an_abort_after_tokenization_is_forwarded(pooled):
    service, gate = pooled
    service.on_generate(generate("r", LONG))
    gate.release_and_wait()
    assert service.on_abort(AbortReq(rid="r")) == [AbortReq(rid="r")]
    assert "r" not in service.reqs


# ---- a real server -----------------------------------------------------------------------------


def post(url: str, body: dict) -> tuple[float, httpx.Response]:
    start = time.monotonic()
    response = httpx.post(url, json=body, timeout=120)
    return time.monotonic() - start, response


def test_huge_prompts_do_not_delay_normal_requests(tmp_path):
    """Normal requests, one after another for as long as four multi-MB prompts are in flight,
    each complete within seconds (before the byte cap, one waited for all four)."""
    with running_server(None, {}, tmp_path / "server.log") as server:
        url = f"{server.url}/v1/completions"
        huge = {"model": "radixlora-demo", "prompt": "y" * BIG_PROMPT_BYTES, "max_tokens": 4}
        chat = {"model": "radixlora-demo", "max_tokens": 4,
                "messages": [{"role": "user", "content": "z" * BIG_PROMPT_BYTES}]}
        normal = {"model": "radixlora-demo", "prompt": "hello", "max_tokens": 4}
        assert post(url, normal)[1].status_code == 200  # warm-up: first-request costs
        latencies = []
        with ThreadPoolExecutor(4) as pool:
            bigs = [pool.submit(post, url, huge) for _ in range(2)]
            bigs += [pool.submit(post, f"{server.url}/v1/chat/completions", chat)
                     for _ in range(2)]
            while not latencies or not all(f.done() for f in bigs):
                seconds, response = post(url, normal)
                assert response.status_code == 200, response.text
                latencies.append(seconds)
            big_results = [f.result()[1] for f in bigs]
        assert max(latencies) < NORMAL_REQUEST_S, latencies
        for big in big_results:
            assert big.status_code == 400
            assert big.json()["error"]["code"] == "context_length_exceeded"
