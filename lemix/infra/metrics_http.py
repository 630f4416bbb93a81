"""A service's own Prometheus endpoint: ``GET /metrics`` on `metrics_port`.

    server = await MetricsServer.start("127.0.0.1", 0)   # 0 = any free port
    server.port                                          # the bound one
    await server.stop()

Serves `prometheus_client`'s default registry (`lemix.infra.telemetry` registers
there) from the service's own event loop (aiohttp), so a scrape never races a
thread. `metrics_port` None (or negative) means no endpoint: `start_optional`
returns None then.
"""

from __future__ import annotations

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from lemix.infra.address import join_host_port

log = structlog.get_logger(__name__)


async def _metrics(request: web.Request) -> web.Response:
    body = generate_latest(REGISTRY)
    response = web.Response(body=body)
    response.headers["Content-Type"] = CONTENT_TYPE_LATEST
    return response


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
    async def start(cls, host: str, port: int) -> MetricsServer:
        """Bind and serve; raises OSError when the port is taken."""
        app = web.Application()
        app.router.add_get("/metrics", _metrics)
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
    async def start_optional(cls, host: str, port: int | None) -> MetricsServer | None:
        """`start`, or None when `port` is None or negative (disabled)."""
        if port is None or port < 0:
            return None
        return await cls.start(host, port)

    async def stop(self) -> None:
        await self._runner.cleanup()
