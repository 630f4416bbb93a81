"""lemix.infra.lifecycle: the one start/stop shape every service shares."""

from __future__ import annotations

import asyncio

import pytest

from lemix.infra.lifecycle import Lifecycle, Service


def _recorder(log: list[str]) -> tuple:
    def hook(name: str):
        def refuse() -> None:
            log.append(name)

        return refuse

    def part(name: str):
        async def stop(grace_s: float) -> None:
            log.append(f"{name}({grace_s})")

        return stop

    def client(name: str):
        async def close() -> None:
            log.append(name)

        return close

    return hook, part, client


async def test_stop_refuses_then_drains_work_then_servers_then_clients() -> None:
    log: list[str] = []
    hook, part, client = _recorder(log)
    life = Lifecycle("test")
    life.add_client("redis", client("redis"))
    life.on_stopping(hook("refuse-node"))
    life.add_work("node", part("node"))
    life.add_server("grpc", part("grpc"))
    life.on_stopping(hook("health"))
    life.add_client("channels", client("channels"))
    life.add_work("heartbeat", part("heartbeat"))
    await life.stop(2.5)
    assert log == [
        "refuse-node",
        "health",
        "heartbeat(2.5)",
        "node(2.5)",
        "grpc(2.5)",
        "channels",
        "redis",
    ]
    log.clear()
    await life.stop(1.0)  # everything was forgotten: nothing runs twice
    assert log == []


async def test_servers_stop_together() -> None:
    both_running = asyncio.Event()
    running: set[str] = set()

    def server(name: str):
        async def stop(grace_s: float) -> None:
            running.add(name)
            if len(running) == 2:
                both_running.set()
            await asyncio.wait_for(both_running.wait(), 1.0)

        return stop

    life = Lifecycle("test")
    life.add_server("grpc", server("grpc"))
    life.add_server("http", server("http"))
    await life.stop(0.0)
    assert running == {"grpc", "http"}


async def test_a_failing_part_does_not_stop_the_rest_and_is_raised() -> None:
    log: list[str] = []
    _, part, client = _recorder(log)

    async def broken(grace_s: float) -> None:
        raise RuntimeError("boom")

    life = Lifecycle("test")
    life.add_client("redis", client("redis"))
    life.add_work("node", part("node"))
    life.add_work("broken", broken)
    with pytest.raises(RuntimeError, match="boom"):
        await life.stop(0.0)
    assert log == ["node(0.0)", "redis"]


class _Service(Service):
    def __init__(self, fail_at: str = "") -> None:
        super().__init__("demo", default_grace_s=7.0)
        self.fail_at = fail_at
        self.log: list[str] = []
        self.num_starts = 0
        self.num_stopped = 0

    @property
    def address(self) -> str:
        return "127.0.0.1:1"

    async def _start(self) -> None:
        self.num_starts += 1

        async def close() -> None:
            self.log.append("redis closed")

        async def stop_loops(grace_s: float) -> None:
            self.log.append(f"loops stopped({grace_s})")

        self.lifecycle.add_client("redis", close)
        if self.fail_at == "redis":
            raise OSError("redis unreachable")
        self.lifecycle.add_work("loops", stop_loops)
        if self.fail_at == "server":
            raise OSError("port busy")

    def _on_stopped(self) -> None:
        self.num_stopped += 1


async def test_a_failed_start_stops_what_it_had_started_and_re_raises() -> None:
    service = _Service(fail_at="server")
    with pytest.raises(OSError, match="port busy"):
        await service.start()
    assert service.log == ["loops stopped(0.0)", "redis closed"]
    await service.stop()  # already stopped: nothing runs twice
    assert service.log == ["loops stopped(0.0)", "redis closed"]
    assert service.num_stopped == 1
    with pytest.raises(RuntimeError, match="stopped"):
        await service.start()


async def test_start_and_stop_are_idempotent_and_stop_uses_the_default_grace() -> None:
    service = _Service()
    await service.start()
    await service.start()
    assert service.num_starts == 1
    await asyncio.gather(service.stop(), service.stop())  # the second waits, then returns
    assert service.log == ["loops stopped(7.0)", "redis closed"]
    assert service.num_stopped == 1
    assert service.other_addresses == {}


async def test_stop_of_a_service_never_started_is_harmless() -> None:
    service = _Service()
    await service.stop(grace_s=0.0)
    assert service.log == [] and service.num_stopped == 1
