"""The LeMix profiler: measures executors and fits the latency models (`lemix.v1.Profiler`).

- `profiler.fit`      — measurements -> fitted `Profile` + fit report (pure).
- `profiler.runner`   — `profile_executor`: drive one executor's `Measure` over a grid.
- `profiler.config`   — `ProfilerConfig` and its env/flag mapping.
- `profiler.convert`  — `RunProfileRequest` -> `ProfileJob`, results -> response.
- `profiler.core`     — `ProfilerCore`: run a job, store the profile in Redis.
- `profiler.servicer` — `ProfilerServicer` (thin: convert, delegate).
- `profiler.service`  — `ProfilerService`: start/stop the server and its Redis client.

Run it with ``python -m profiler [flags]``; ``lemix profile`` runs the runner
directly against one executor, no service needed.
"""
