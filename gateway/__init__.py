"""The LeMix gateway: the public gRPC API (`lemix.v1.Gateway`) and an
OpenAI-compatible HTTP API, one request path behind both.

- `gateway.config`           — `GatewayConfig` and its env/flag mapping.
- `lemix.tokenizer`        — the `Tokenizer` protocol and the emulation stand-in.
- `gateway.validate`         — requests -> domain tasks, or `InvalidArgument`.
- `gateway.convert`          — output-stream messages and Redis state -> responses.
- `gateway.core`             — `GatewayCore`: admission, Submit, output streams, cancel.
- `gateway.admission`        — `GatewayCore`'s base: in-flight slots, liveness, counters.
- `gateway.servicer`         — `GatewayServicer` (thin: gRPC -> core).
- `gateway.openai_convert`   — OpenAI JSON -> requests (then `gateway.validate`).
- `gateway.openai_responses` — responses -> OpenAI JSON; errors -> HTTP statuses.
- `gateway.http_api`         — the aiohttp routes (thin: HTTP -> core); with
  `gateway.http_middleware` (headers, API key, errors), `gateway.http_body`
  (JSON bodies), `gateway.http_sse` (streams, disconnects), `gateway.http_cors`.
- `gateway.service`          — `GatewayService`: start/stop the servers and clients.

Run it with ``python -m gateway [flags]``.
"""
