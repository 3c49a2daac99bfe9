"""--otlp-traces-endpoint: a demo server's spans received by a local OTLP/HTTP endpoint (no
collector), one per request with the GenAI attributes; the start-up error without the extra."""

from __future__ import annotations

import http.server
import sys
import threading

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from radixlora.errors import RadixLoraError
from radixlora.sampling_params import SamplingParams
from radixlora.sched.adapter_choice import AdapterChoice
from radixlora.server.args import Endpoints, ServerArgs
from radixlora.server.http.bridge import ProcessBridge
from radixlora.server.http.tracing import Tracer
from radixlora.server.messages import GenerateReq
from tests.server_harness import free_port, running_server
from tests.test_stats_log import end_three_ways


class Collector(http.server.ThreadingHTTPServer):
    """Keeps the spans of every OTLP/HTTP protobuf export POSTed to /v1/traces."""

    def __init__(self, port: int):
        self.spans = []
        self.paths = []
        super().__init__(("127.0.0.1", port), CollectorHandler)


class CollectorHandler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["content-length"]))
        export = ExportTraceServiceRequest.FromString(body)
        self.server.paths.append(self.path)
        for resource_spans in export.resource_spans:
            service = {a.key: value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                self.server.spans += [(service, span) for span in scope_spans.spans]
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value(x) for x in v.array_value.values]
    return getattr(v, kind)


def test_demo_server_exports_one_span_per_request_with_genai_attributes(tmp_path):
    collector = Collector(free_port())
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{collector.server_address[1]}/v1/traces"
    try:
        with running_server(None, {}, tmp_path / "server.log",
                            "--otlp-traces-endpoint", endpoint) as proc:
            cards = {c["id"]: c for c in proc.http.get("/v1/models").json()["data"]}
            replies = {}
            for model in ("radixlora-demo", "radixlora-demo:upper"):
                body = {"model": model, "prompt": "input: a cat\noutput:\n", "max_tokens": 12,
                        "temperature": 0}
                replies[model] = proc.http.post("/v1/completions", json=body).json()
            chat = {"model": "radixlora-demo", "max_tokens": 5, "temperature": 0.5,
                    "messages": [{"role": "user", "content": "a dog"}]}
            chat_reply = proc.http.post("/v1/chat/completions", json=chat).json()
    finally:
        collector.shutdown()
    assert set(collector.paths) == {"/v1/traces"}
    assert len(collector.spans) == 3
    spans = {}
    for service, span in collector.spans:
        assert service["service.name"] == "radixlora"
        attrs = {a.key: value(a.value) for a in span.attributes}
        spans[attrs["gen_ai.response.id"]] = (span, attrs)
    for model, reply in replies.items():
        span, attrs = spans[f"{reply['id']}-0"]
        assert span.name == "text_completion radixlora-demo"
        assert span.kind == span.SPAN_KIND_INTERNAL
        assert attrs["gen_ai.operation.name"] == "text_completion"
        assert attrs["gen_ai.request.model"] == "radixlora-demo"
        assert attrs["gen_ai.request.max_tokens"] == 12
        assert attrs["gen_ai.request.temperature"] == 0.0
        assert attrs["gen_ai.usage.input_tokens"] == reply["usage"]["prompt_tokens"]
        assert attrs["gen_ai.usage.output_tokens"] == reply["usage"]["completion_tokens"]
        assert attrs["gen_ai.response.finish_reasons"] == [reply["choices"][0]["finish_reason"]]
        if model.endswith(":upper"):
            assert attrs["gen_ai.adapter.name"] == "upper"
            assert attrs["gen_ai.adapter.id"] == cards["upper"]["adapter_id"]
        else:
            assert attrs["gen_ai.adapter.name"] == "base"
            assert "gen_ai.adapter.id" not in attrs
        ttft = attrs["gen_ai.latency.time_to_first_token"]
        decode = attrs["gen_ai.latency.time_in_model_decode"]
        e2e = attrs["gen_ai.latency.e2e"]
        assert 0 < ttft <= e2e and 0 <= decode <= e2e
        assert abs(ttft + decode - e2e) < 1e-6
        queued = attrs["gen_ai.latency.time_in_queue"]
        prefill = attrs["gen_ai.latency.time_in_model_prefill"]
        assert queued >= 0 and prefill >= 0 and abs(queued + prefill - ttft) < 1e-6
        assert span.end_time_unix_nano - span.start_time_unix_nano == pytest.approx(e2e * 1e9,
                                                                                    abs=1e6)
    span, attrs = spans[chat_reply["id"]]
    assert span.name == "chat radixlora-demo"
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.request.temperature"] == 0.5
    assert attrs["gen_ai.usage.output_tokens"] == chat_reply["usage"]["completion_tokens"]


def test_without_an_endpoint_nothing_is_imported_or_recorded():
    tracer = Tracer.for_endpoint(None, "m")
    assert not tracer.enabled
    tracer.record(object(), "stop", {})  # a no-op: it reads nothing of the generation
    tracer.shutdown()


def test_missing_sdk_is_a_start_up_error_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
    with pytest.raises(RadixLoraError, match=r"radixlora\[otel\]"):
        Tracer.for_endpoint("http://127.0.0.1:1/v1/traces", "m")


def test_bridge_ends_one_span_per_generation_finished_aborted_or_failed(tmp_path):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    args = ServerArgs(model="m", served_model_name="m", endpoints=Endpoints.in_dir(tmp_path))
    bridge = ProcessBridge(args, tracer=Tracer("m", provider))
    bridge.adapter_ids = {"sql": "sha-of-sql"}
    params = SamplingParams(max_tokens=7, n=1)
    end_three_ways(bridge, [GenerateReq(rid=rid, params=params, prompt="secret",
                                        adapters=[AdapterChoice("sql")],
                                        fill_context=rid == "gone")
                            for rid in ("done", "gone", "failed")])
    spans = {s.attributes["gen_ai.response.id"]: s for s in exporter.get_finished_spans()}
    assert list(spans) == ["done", "gone", "failed"]
    done = spans["done"]
    assert done.name == "text_completion m"
    assert done.attributes["gen_ai.usage.input_tokens"] == 9
    assert done.attributes["gen_ai.usage.output_tokens"] == 5
    assert done.attributes["radixlora.usage.cached_tokens"] == 4
    assert done.attributes["gen_ai.request.max_tokens"] == 7
    assert done.attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert done.attributes["gen_ai.adapter.id"] == "sha-of-sql"
    assert done.attributes["gen_ai.adapter.name"] == "sql"
    assert done.status.is_ok
    assert spans["gone"].attributes["gen_ai.response.finish_reasons"] == ("abort",)
    assert "gen_ai.request.max_tokens" not in spans["gone"].attributes  # none was asked for
    failed = spans["failed"]
    assert failed.status.status_code is StatusCode.ERROR
    assert failed.attributes["error.type"] == "drain_timeout"
    assert "gen_ai.latency.time_to_first_token" not in failed.attributes
