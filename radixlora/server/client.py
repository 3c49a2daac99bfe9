"""A Python client for the ZeroMQ entry of a running `radixlora serve` (no HTTP, no JSON):

    client = RuntimeClient(endpoint)          # printed at start-up and in /get_server_info
    samples = client.generate("Hello", SamplingParams(max_tokens=8), adapters=[("sql", 1.0)])
    for out in client.stream("Hello", SamplingParams(max_tokens=8)): print(out.text, end="")
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import msgspec
import zmq

from radixlora.errors import RadixLoraError
from radixlora.sampling_params import SamplingParams
from radixlora.sched.adapter_choice import parse_spec
from radixlora.server.http.bridge import Sample
from radixlora.server.ipc import check_local
from radixlora.server.messages import (
    AbortReq,
    ChatMessage,
    Codec,
    GenerateReq,
    OutputBatch,
    ReqError,
    SampleOutput,
    bytes_to_id_list,
    ids_to_bytes,
)


class RequestError(RadixLoraError):
    def __init__(self, error: ReqError):
        super().__init__(f"{error.status} {error.code}: {error.message}")
        self.error = error


class RuntimeClient:
    def __init__(self, endpoint: str, timeout_s: float = 120.0, api_key: str | None = None):
        """api_key: the server's --zmq-client-key (or, without one, its --api-key)."""
        check_local(endpoint)
        self.key = api_key.encode() if api_key else None
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.timeout_ms = int(timeout_s * 1000)
        self.codec = Codec(OutputBatch | ReqError)
        self.encoder = msgspec.msgpack.Encoder()

    def stream(
        self,
        prompt: str | list[int] | None = None,
        params: SamplingParams | None = None,
        adapters: str | list[tuple[str, float]] | None = None,
        stop: list[str] | None = None,
        messages: list[dict] | None = None,
    ) -> Iterator[SampleOutput]:
        """SampleOutputs as they arrive, until every sample finished."""
        params = params or SamplingParams()
        rid = uuid.uuid4().hex
        self._send(_request(rid, prompt, params, adapters, stop, messages))
        done: set[int] = set()
        try:
            while len(done) < params.n:
                for out in self._recv(rid):
                    if out.finish_reason is not None:
                        done.add(out.index)
                    yield out
        finally:
            if len(done) < params.n:
                self._send(AbortReq(rid=rid))

    def generate(self, prompt=None, params=None, adapters=None, stop=None, messages=None):
        """The finished samples of one prompt, by index."""
        samples: dict[int, Sample] = {}
        for out in self.stream(prompt, params, adapters, stop, messages):
            sample = samples.setdefault(out.index, Sample(out.index))
            sample.add(out, bytes_to_id_list(out.token_ids))
        return [samples[i] for i in sorted(samples)]

    def _send(self, msg) -> None:
        raw = self.encoder.encode(msg)
        self.sock.send_multipart([self.key, raw] if self.key else [raw])

    def _recv(self, rid: str) -> list[SampleOutput]:
        if not self.sock.poll(self.timeout_ms):
            raise TimeoutError(f"no answer from the server in {self.timeout_ms} ms")
        msg = self.codec.decode(self.sock.recv())
        if isinstance(msg, ReqError) and msg.rid == rid:
            raise RequestError(msg)
        if isinstance(msg, OutputBatch):
            return [out for out in msg.outputs if out.rid == rid]
        return []

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def _request(rid, prompt, params, adapters, stop, messages) -> GenerateReq:
    text, ids = (prompt, None) if isinstance(prompt, str) or prompt is None else (
        None, ids_to_bytes(prompt))
    return GenerateReq(
        rid=rid,
        params=params,
        prompt=text,
        input_ids=ids,
        messages=[ChatMessage(role=m["role"], content=m["content"]) for m in messages]
        if messages is not None else None,
        adapters=parse_spec(adapters) or None,
        stop=list(stop or params.stop),
    )
