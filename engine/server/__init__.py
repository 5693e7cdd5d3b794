"""Hearth's local OpenAI-compatible HTTP server (`hearth serve`).

Modules, each with one job:
  errors       the OpenAI-style error type every rejected request turns into
  protocol     request validation (typed, bounded) and response/chunk bodies
  constraints  structured output: JSON / JSON-schema constrained decoding (llguidance token masks)
  scheduler    continuous batching: per-sequence KV caches, chunked prefill, one batched decode step
               for all running sequences, the shared prefix store
  metrics      Prometheus text metrics (requests, tokens, TTFT and tokens/s histograms)
  app          the Starlette application: routes, Host/API-key/size guards, SSE streaming,
               disconnect -> cancel, per-request timeout
"""

from engine.server.app import ServerConfig, create_app

__all__ = ["ServerConfig", "create_app"]
