"""`runtime.engines.loopback`: a store server for a loopback address listens on 127.0.0.1 only."""

from __future__ import annotations

import psutil
import pytest
import torch.distributed as dist

from pipectl.artifacts.run import is_loopback_address as is_loopback
from pipectl.runtime.engines.loopback import LoopbackTCPStore


def listening_on(port: int) -> list[str]:
    return [c.laddr.ip for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port]  # fmt: skip


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1"])
def test_a_loopback_store_server_binds_127_0_0_1_and_serves_clients(host):
    server = LoopbackTCPStore(host, 0, None, True, wait_for_workers=False)
    assert isinstance(server, dist.TCPStore)
    assert listening_on(server.port) == ["127.0.0.1"]
    client = dist.TCPStore("127.0.0.1", server.port, None, False)
    client.set("rank0", "here")
    assert server.get("rank0") == b"here"


def test_loopback_names():
    assert all(map(is_loopback, ["localhost", "127.0.0.1", "127.1.2.3", "::1"]))
    assert not any(map(is_loopback, ["10.0.0.1", "node7", "0.0.0.0", ""]))
