"""A service's own Prometheus endpoint: ``GET /metrics`` on `metrics_port`.

    server = await MetricsServer.start("127.0.0.1", 0, "executor")  # 0 = any free port
    server.port                                                      # the bound one
    await server.stop()

Serves the service's view of `prometheus_client`'s default registry
(`lemix.infra.telemetry.registry_for`: no other service's families) from the
service's own event loop (aiohttp), so a scrape never races a thread.
`metrics_port` None (or negative) means no endpoint: `start_optional`
returns None then.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from lemix.infra import telemetry
from lemix.infra.address import join_host_port

log = structlog.get_logger(__name__)


def _metrics_of(service: str) -> Callable[[web.Request], Awaitable[web.Response]]:
    registry = telemetry.registry_for(service)

    async def metrics(request: web.Request) -> web.Response:
        response = web.Response(body=generate_latest(registry))
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    return metrics


class MetricsServer:
    """One aiohttp site serving ``/metrics``; build it with `start`."""

    def __init__(self, runner: web.AppRunner, host: str, port: int) -> None:
        self._runner = runner
        self.host = host
        self.port = port

    @property
    def address(self) -> str:
        """host:port to scrape (an IPv6 host in brackets)."""
        return join_host_port(self.host, self.port)

    @classmethod
    async def start(cls, host: str, port: int, service: str) -> MetricsServer:
        """Bind and serve `service`'s metrics (gateway|scheduler|executor|profiler);
        raises OSError when the port is taken."""
        app = web.Application()
        app.router.add_get("/metrics", _metrics_of(service))
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, host, port, reuse_address=True)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        addresses = runner.addresses  # (host, port, ...) of every bound socket
        server = cls(runner, host, int(addresses[0][1]) if addresses else port)
        log.info("metrics.serving", address=server.address)
        return server

    @classmethod
    async def start_optional(
        cls, host: str, port: int | None, service: str
    ) -> MetricsServer | None:
        """`start`, or None when `port` is None or negative (disabled)."""
        if port is None or port < 0:
            return None
        return await cls.start(host, port, service)

    async def stop(self) -> None:
        await self._runner.cleanup()
