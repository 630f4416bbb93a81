"""gRPC plumbing shared by the LeMix services.

- `convert` — protobuf <-> domain conversion for tasks and node states.
- `errors`  — domain errors and their gRPC status codes.
- `server`  — `start_server` / `stop_server` (health, reflection, limits).
- `client`  — `channel`, `DEFAULT_DEADLINE_S`, `wait_for_serving`.
- `auth`    — the shared service token on internal RPCs (option, check, client side).
- `guard`   — server interceptors: malformed requests, the service token.
- `tls`     — optional TLS/mTLS for the gateway's public API.

Generated stubs live in `lemix._proto.lemix.v1` (`make proto` regenerates them).
The full names of the services, for `start_server(service_names=...)`, are below.
"""

GATEWAY_SERVICE = "lemix.v1.Gateway"
SCHEDULER_SERVICE = "lemix.v1.Scheduler"
EXECUTOR_SERVICE = "lemix.v1.Executor"
PROFILER_SERVICE = "lemix.v1.Profiler"
