"""The server's pieces without sockets or subprocesses: incremental detokenization and stop
strings, message codecs against garbage, the chat template, and the scheduler and worker
services driven through msgpack-encoded messages, which must reproduce the offline Engine."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlora import Engine, SamplingParams
from radixlora.server.args import ServerArgs
from radixlora.server.messages import (
    AbortReq,
    AdapterChoice,
    Codec,
    SchedulerInbox,
    StepResult,
    TokenizedReq,
    WorkerInbox,
    bytes_to_id_list,
    bytes_to_ids,
    ids_to_bytes,
)
from radixlora.server.procs.scheduler_proc import SchedulerService
from radixlora.server.procs.tokenizer_proc import TokenizerService
from radixlora.server.procs.worker_proc import make_executor, prefetch_adapters
from radixlora.text.chat import DEFAULT_CHAT_TEMPLATE, ChatTemplate
from radixlora.text.detokenize import IncrementalDecoder, StopMatcher
from radixlora.text.tokenizer import Tokenizer
from tests.server_harness import build_checkpoints, sized


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return build_checkpoints(tmp_path_factory.mktemp("units"))


@pytest.fixture(scope="module")
def tokenizer(checkpoints):
    return Tokenizer.from_dir(checkpoints[0])


# ---- detokenization ------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(0, 511), max_size=40), cuts=st.lists(st.integers(1, 5)))
def test_incremental_decode_equals_full_decode(tokenizer, ids, cuts):
    dec, text, pos = IncrementalDecoder(tokenizer), "", 0
    for cut in cuts + [len(ids)]:
        text += dec.push(ids[pos : pos + cut])
        pos += cut
    text += dec.flush()
    assert text == tokenizer.decode(ids)


@settings(max_examples=200, deadline=None)
@given(text=st.text("abc", max_size=30), stops=st.lists(st.text("abc", min_size=1, max_size=4),
                                                        max_size=3),
       cuts=st.lists(st.integers(1, 4), max_size=30))
def test_stop_matcher_streams_the_cut_text(text, stops, cuts):
    want, matched = text, False
    for end in range(1, len(text) + 1):  # the stop that completes first, char by char
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            want, matched = text[: end - max(map(len, ending))], True
            break
    matcher, out, pos = StopMatcher(stops), "", 0
    for cut in cuts + [len(text)]:
        out += matcher.feed(text[pos : pos + cut])
        pos += cut
        if matcher.matched is not None:
            break
    if matcher.matched is None:
        out += matcher.flush()
    assert out == want
    assert (matcher.matched is not None) == matched


def test_chat_template_default_and_checkpoint(tmp_path):
    messages = [{"role": "user", "content": "hi"}]
    assert ChatTemplate(DEFAULT_CHAT_TEMPLATE).render(messages) == "<|user|>\nhi\n<|assistant|>\n"
    (tmp_path / "tokenizer_config.json").write_text(msgspec.json.encode({
        "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.content }}]{% endfor %}",
        "bos_token": {"content": "<s>"},
    }).decode())
    assert ChatTemplate.from_dir(tmp_path).render(messages) == "<s>[hi]"


# ---- messages ------------------------------------------------------------------------------------


def test_ids_roundtrip_as_raw_int32():
    ids = np.array([0, 1, 2**31 - 1, 7], np.int32)
    raw = ids_to_bytes(ids)
    assert raw == ids.astype("<i4").tobytes() and (bytes_to_ids(raw) == ids).all()
    with pytest.raises(ValueError):
        bytes_to_ids(b"\x00" * 5)


@pytest.mark.parametrize("inbox", [SchedulerInbox, WorkerInbox])
@settings(max_examples=100, deadline=None)
@given(raw=st.binary(max_size=200))
def test_garbage_never_decodes_to_a_message_by_accident(inbox, raw):
    msg = Codec(inbox).decode(raw)  # never raises
    assert msg is None or isinstance(msg, msgspec.Struct)


def test_codec_roundtrip_and_wrong_inbox():
    req = TokenizedReq(rid="r", input_ids=ids_to_bytes([1, 2]), params=SamplingParams(n=2),
                       adapters=[AdapterChoice("a", 0.5)])
    raw = Codec(SchedulerInbox).encode(req)
    assert Codec(SchedulerInbox).decode(raw) == req
    assert Codec(WorkerInbox).decode(raw) is None  # not a worker message: dropped


# ---- scheduler + worker services over encoded messages -----------------------------------------


def _drive(scheduler: SchedulerService, worker, reqs, abort_after=None):
    """Run to completion as the processes do (the next step planned and launched before the
    previous one's results are folded in), every message crossing msgpack as over a socket."""
    to_worker, to_sched = Codec(WorkerInbox), Codec(SchedulerInbox)
    for req in reqs:
        assert scheduler.add(to_sched.decode(to_sched.encode(req))) is None
    tokens: dict[tuple[str, int], list[int]] = {}
    steps = 0
    while True:
        while (plan := scheduler.next_plan()) is not None:
            worker.submit(to_worker.decode(to_worker.encode(plan)))
        if not worker.in_flight:
            break
        (result,) = worker.collect(keep=len(worker.in_flight) - 1)
        batch, errors = scheduler.on_result(to_sched.decode(to_sched.encode(result)))
        assert not errors
        for out in batch.outputs if batch else []:
            tokens.setdefault((out.rid, out.index), []).extend(bytes_to_ids(out.token_ids))
        steps += 1
        if abort_after is not None and steps == abort_after[1]:
            scheduler.abort(AbortReq(rid=abort_after[0]))
    return tokens


def test_services_reproduce_the_engine(checkpoints):
    model, adapters = checkpoints
    engine_kw = dict(kv_pages=40, max_running=8, adapter_rows=32)  # small: forces retraction
    args = ServerArgs(model=str(model), adapters={k: str(v) for k, v in adapters.items()},
                      engine=engine_kw)
    scheduler, worker = SchedulerService(sized(args)), make_executor(args)
    engine = Engine(model, adapters=adapters, **engine_kw)
    specs = [None, "support", "legal", [("support", 1.0), ("legal", 0.5)]]
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=3, n=2, ignore_eos=True)
    prompts = [[3, 4, 5, 6, 7], [3, 4, 5, 9], [10, 11], [3, 4, 5, 6, 7, 8]]
    want = engine.generate(prompts, params, adapters=specs)
    reqs = [
        TokenizedReq(rid=f"r{i}", input_ids=ids_to_bytes(p), params=params,
                     adapters=[AdapterChoice(n, w) for n, w in
                               ([(s, 1.0)] if isinstance(s, str) else s or [])] or None)
        for i, (p, s) in enumerate(zip(prompts, specs))
    ]
    got = _drive(scheduler, worker, reqs)
    for i, out in enumerate(want):
        for o in out.outputs:
            assert got[(f"r{i}", o.index)] == o.token_ids
    assert scheduler.scheduler.num_retractions > 0
    info = scheduler.info(flush_cache=True)
    assert info["kv_free_tokens"] == info["kv_capacity_tokens"] and not info["open_requests"]


def test_worker_prefetches_the_startup_adapters_the_scheduler_will_load(checkpoints):
    model, adapters = checkpoints
    args = ServerArgs(model=str(model), adapters={k: str(v) for k, v in adapters.items()})
    worker = make_executor(args)
    assert prefetch_adapters(worker.runner, args) == 2
    scheduler = SchedulerService(sized(args))
    ids = {a.adapter_id for a in scheduler.adapters.by_name.values()}
    assert set(worker.runner.adapter_pool.host.ids()) == ids
    def missed(load):
        raise AssertionError(f"adapter {load.name} missed the host tier")

    worker.reader.source = missed
    reqs = [TokenizedReq(rid=name, input_ids=ids_to_bytes([3, 4, 5]),
                         params=SamplingParams(max_tokens=2, ignore_eos=True),
                         adapters=[AdapterChoice(name)]) for name in adapters]
    got = _drive(scheduler, worker, reqs)
    assert sorted(got) == [(name, 0) for name in sorted(adapters)]
    one = max(worker.runner.adapter_pool.host.get(i).nbytes for i in ids)
    small = ServerArgs(model=str(model), adapters=args.adapters,
                       engine={"host_adapter_bytes": one})
    assert prefetch_adapters(make_executor(small).runner, small) == 1


def test_abort_mid_decode_frees_everything(checkpoints):
    model, adapters = checkpoints
    args = ServerArgs(model=str(model), adapters={k: str(v) for k, v in adapters.items()},
                      engine={"kv_pages": 64})
    scheduler, worker = SchedulerService(sized(args)), make_executor(args)
    params = SamplingParams(max_tokens=40, ignore_eos=True, n=3)
    req = TokenizedReq(rid="x", input_ids=ids_to_bytes([5, 6, 7]), params=params,
                       adapters=[AdapterChoice("legal")])
    got = _drive(scheduler, worker, [req], abort_after=("x", 4))
    assert all(len(v) < 40 for v in got.values())
    info = scheduler.info()
    assert info["kv_protected_tokens"] == 0 and not info["open_requests"]
    assert info["kv_free_tokens"] + info["kv_cached_tokens"] == info["kv_capacity_tokens"]
    assert all(refs == 0 for refs in info["adapter_refs"].values())


def test_stale_step_results_are_dropped(checkpoints):
    model, _ = checkpoints
    scheduler = SchedulerService(sized(ServerArgs(model=str(model), engine={"kv_pages": 32})))
    assert scheduler.on_result(StepResult(step=99)) == (None, [])


def test_tokenizer_service_applies_stop_strings(checkpoints):
    from radixlora.server.messages import GenerateReq, TokenBatch, TokenOut

    service = TokenizerService(sized(ServerArgs(model=str(checkpoints[0]))))
    ids = service.tokenizer.encode("The quick brown fox jumps")
    req = GenerateReq(rid="s", params=SamplingParams(max_tokens=20), prompt="x", stop=["brown"])
    service.on_generate(req)
    outs, aborts = [], []
    for t in ids:
        out = TokenOut(rid="s", index=0, token_ids=ids_to_bytes([t]), logprobs=[0.0], top=None,
                       finish_reason=None, prompt_tokens=1, cached_tokens=0)
        a, o = service.on_tokens(TokenBatch(outputs=[out]))
        aborts += a
        outs += [s for batch in o for s in batch.outputs]
    assert "".join(o.text for o in outs) == "The quick "
    assert outs[-1].finish_reason == "stop" and outs[-1].matched_stop == "brown"
    assert aborts == [AbortReq(rid="s", index=0)]


def test_a_request_whose_output_fails_to_detokenize_ends_alone(checkpoints, monkeypatch):
    """An exception while one request's tokens become text ends that request with a 500 (and
    an abort for the scheduler); the other request of the batch goes on."""
    from radixlora.server.messages import GenerateReq, OutputBatch, ReqError, TokenBatch, TokenOut

    service = TokenizerService(sized(ServerArgs(model=str(checkpoints[0]))))
    for rid in ("bad", "good"):
        service.on_generate(GenerateReq(rid=rid, params=SamplingParams(max_tokens=4), prompt="x"))
    real = service._output
    monkeypatch.setattr(service, "_output", lambda state, out: (
        1 / 0 if out.rid == "bad" else real(state, out)))
    outs = [TokenOut(rid=rid, index=0, token_ids=ids_to_bytes([5]), logprobs=[0.0], top=None,
                     finish_reason=None, prompt_tokens=1, cached_tokens=0)
            for rid in ("bad", "good")]
    aborts, to_api = service.on_tokens(TokenBatch(outputs=outs))
    assert aborts == [AbortReq(rid="bad")]
    batch, error = to_api
    assert isinstance(batch, OutputBatch) and [o.rid for o in batch.outputs] == ["good"]
    assert isinstance(error, ReqError) and (error.rid, error.status) == ("bad", 500)
    assert "bad" not in service.reqs and "good" in service.reqs


@given(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=40))
def test_id_lists_read_from_bytes_equal_numpys(ids):
    raw = ids_to_bytes(ids)
    assert bytes_to_id_list(raw) == bytes_to_ids(raw).tolist() == ids
    with pytest.raises(ValueError, match="multiple of 4"):
        bytes_to_id_list(raw + b"\0")
