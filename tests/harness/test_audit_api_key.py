"""`lemix audit` (and `lemix replay`'s channel) against a gateway that requires
an API key: a real gRPC server with the key check, a stub Gateway servicer."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc.aio
import pytest

from lemix._proto.lemix.v1 import gateway_pb2, gateway_pb2_grpc
from lemix.harness.audit import AuditConfig, audit_config, run_audit
from lemix.harness.replay import ReplayConfig
from lemix.infra.rpc import GATEWAY_SERVICE
from lemix.infra.rpc.errors import InvalidArgument
from lemix.infra.rpc.server import start_server

KEY = "sk-audit-test-key"


class _AuditOnly(gateway_pb2_grpc.GatewayServicer):
    async def AuditTasks(
        self, request: gateway_pb2.AuditRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.AuditReply:
        return gateway_pb2.AuditReply(num_scanned=5)


@pytest.fixture
async def keyed_target() -> AsyncIterator[str]:
    server, port, _ = await start_server(
        [(gateway_pb2_grpc.add_GatewayServicer_to_server, _AuditOnly())],
        "127.0.0.1",
        0,
        service_names=[GATEWAY_SERVICE],
        api_keys=(KEY,),
    )
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


async def test_audit_sends_its_api_key(keyed_target: str) -> None:
    result = await run_audit(AuditConfig(target=keyed_target, api_key=KEY))
    assert (result.tasks, result.num_scanned) == ([], 5)
    for wrong in ("", "sk-wrong"):
        with pytest.raises(InvalidArgument, match="UNAUTHENTICATED") as info:
            await run_audit(AuditConfig(target=keyed_target, api_key=wrong))
        assert "--api-key" in str(info.value) and KEY not in str(info.value)


def test_audit_and_replay_read_the_key_from_the_flag_or_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import argparse

    from lemix.cli.service_args import api_key_arg

    args = argparse.Namespace(
        target="127.0.0.1:1",
        older_than=0.0,
        limit=1,
        deadline=1.0,
        json=None,
        tls_ca_file="",
        api_key=None,
    )
    monkeypatch.setenv("LEMIX_API_KEY", KEY)
    assert audit_config(args).api_key == KEY
    assert api_key_arg(args) == KEY
    args.api_key = "sk-flag"
    assert audit_config(args).api_key == "sk-flag" and api_key_arg(args) == "sk-flag"
    config = ReplayConfig(target="127.0.0.1:1", api_key=KEY)
    assert KEY not in repr(config) and KEY not in repr(AuditConfig("127.0.0.1:1", api_key=KEY))
