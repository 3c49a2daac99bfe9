"""The api process: HTTP handlers (OpenAI, SGLang, admin, utilities), the bridge to the
tokenizer and scheduler processes, the ZeroMQ client gateway, metrics, tracing and the stats
log."""
