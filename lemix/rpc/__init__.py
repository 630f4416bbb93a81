"""gRPC plumbing shared by the LeMix services.

- `lemix.rpc.convert` — the one protobuf <-> domain conversion module.
- `lemix.rpc.errors`  — domain errors and their gRPC status codes, in one place.
- `lemix.rpc.server`  — `start_server` / `stop_server` (health, reflection, limits).
- `lemix.rpc.client`  — `channel`, `DEFAULT_DEADLINE_S`, `wait_for_serving`.
- `lemix.rpc.auth`    — the shared service token on internal RPCs (option, check, client side).
- `lemix.rpc.guard`   — server interceptors: malformed requests, the service token.

Generated stubs live in `lemix._proto.lemix.v1` (`make proto` regenerates them).
The full names of the services, for `start_server(service_names=...)`, are below.
"""

GATEWAY_SERVICE = "lemix.v1.Gateway"
SCHEDULER_SERVICE = "lemix.v1.Scheduler"
EXECUTOR_SERVICE = "lemix.v1.Executor"
PROFILER_SERVICE = "lemix.v1.Profiler"
