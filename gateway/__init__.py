"""The LeMix gateway: the public gRPC API (`lemix.v1.Gateway`).

- `gateway.config`    — `GatewayConfig` and the one env/flag mapping.
- `gateway.tokenizer` — the `Tokenizer` protocol and the emulation stand-in.
- `gateway.validate`  — requests -> domain tasks, or `InvalidArgument`.
- `gateway.convert`   — output-stream messages and Redis state -> responses.
- `gateway.servicer`  — `GatewayServicer` (thin: validate, convert, delegate).
- `gateway.service`   — `GatewayService`: start/stop the server and its clients.

Run it with ``python -m gateway [flags]``.
"""
