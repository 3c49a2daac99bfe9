"""OpenTelemetry tracing of the api process: one span per generation (one prompt of a client
request), from its arrival to its last token, with the GenAI semantic-convention attributes.
Off unless --otlp-traces-endpoint is set; the SDK is imported only then (the `otel` extra)."""

from __future__ import annotations

import logging
import time

from radixlora.errors import RadixLoraError
from radixlora.protocol.common import adapter_label

log = logging.getLogger(__name__)

EXTRA_HINT = "pip install 'radixlora[otel]'"


def check_available() -> None:
    """Raise a RadixLoraError naming the extra to install when the packages are missing."""
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as e:
        raise RadixLoraError(f"--otlp-traces-endpoint needs the OpenTelemetry SDK and OTLP/HTTP "
                             f"exporter ({e.name} is missing): {EXTRA_HINT}") from e


class Tracer:
    """Spans for finished, failed or aborted generations; a no-op when disabled."""

    def __init__(self, model: str, provider=None):
        """provider: an SDK TracerProvider; None: tracing off."""
        self.model = model
        self.provider = provider
        self.tracer = None if provider is None else provider.get_tracer("radixlora")

    @classmethod
    def for_endpoint(cls, endpoint: str | None, model: str) -> Tracer:
        """Spans batched to an OTLP/HTTP protobuf endpoint (a collector's /v1/traces URL);
        endpoint None or empty: off, and nothing of OpenTelemetry is imported."""
        if not endpoint:
            return cls(model)
        check_available()
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider = TracerProvider(resource=Resource.create({"service.name": "radixlora"}))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        log.info("tracing: OTLP/HTTP spans to %s", endpoint)
        return cls(model, provider)

    @property
    def enabled(self) -> bool:
        return self.tracer is not None

    def record(self, gen, finish: str, adapter_ids: dict[str, str], error: str | None = None
               ) -> None:
        """gen (a bridge Generation) ended now with `finish` (finish reasons, or "abort")."""
        if self.tracer is None:
            return
        end_mono = time.monotonic()
        now_ns = time.time_ns()
        start_ns = now_ns - int((end_mono - gen.created) * 1e9)
        req = gen.req
        params = req.params
        operation = "chat" if req.messages is not None else "text_completion"
        attrs: dict[str, object] = {
            "gen_ai.operation.name": operation,
            "gen_ai.system": "radixlora",
            "gen_ai.request.model": self.model,
            "gen_ai.response.model": self.model,
            "gen_ai.response.id": req.rid,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
            "gen_ai.request.choice.count": params.n,
            "gen_ai.usage.input_tokens": gen.prompt_tokens,
            "gen_ai.usage.output_tokens": sum(len(s.token_ids) for s in gen.samples.values()),
            "gen_ai.response.finish_reasons": [r for r in finish.split(",") if r],
            "gen_ai.adapter.name": adapter_label(req.adapters),
            "radixlora.usage.cached_tokens": gen.cached_tokens,
            "gen_ai.latency.e2e": end_mono - gen.created,
        }
        if not req.fill_context:  # else max_tokens is what the context left, not a request
            attrs["gen_ai.request.max_tokens"] = params.max_tokens
        names = [c.name for c in req.adapters or []]
        ids = [adapter_ids[n] for n in names if n in adapter_ids]
        if ids and len(ids) == len(names):
            attrs["gen_ai.adapter.id"] = ids[0] if len(ids) == 1 else ",".join(ids)
        if gen.fallback:
            attrs["radixlora.adapter.fallback"] = gen.fallback
        if gen.base_mismatch:
            attrs["radixlora.adapter.base_mismatch"] = gen.base_mismatch
        if gen.first_token_at is not None:
            ttft = gen.first_token_at - gen.created
            attrs["gen_ai.latency.time_to_first_token"] = ttft
            attrs["gen_ai.latency.time_in_model_decode"] = end_mono - gen.first_token_at
            if gen.scheduled_at is not None:
                scheduled = min(max(gen.scheduled_at, gen.created), gen.first_token_at)
                attrs["gen_ai.latency.time_in_queue"] = scheduled - gen.created
                attrs["gen_ai.latency.time_in_model_prefill"] = gen.first_token_at - scheduled
        span = self.tracer.start_span(f"{operation} {self.model}", start_time=start_ns,
                                      attributes=attrs)
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            span.set_attribute("error.type", error)
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=now_ns)

    def shutdown(self) -> None:
        """Flush the spans still batched (at server exit)."""
        if self.provider is not None:
            self.provider.shutdown()
