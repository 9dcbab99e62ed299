"""Stores that listen on loopback only, and torchrun for one machine with them.

torch's `TCPStore` server listens on every interface whatever host name it is given (its libuv
backend binds the wildcard address), and a store asks for no password: whoever reaches its port
reads and writes the rendezvous's keys, the addresses of every rank among them. A job whose ranks
all run on this machine needs no other interface. So

- the local engine runs torchrun as `python -m pipectl.runtime.engines.loopback TORCHRUN-ARGS`: torchrun
  itself (`torch.distributed.run.main`), with every store server it creates bound to 127.0.0.1,
  its c10d rendezvous on 127.0.0.1 and its node address 127.0.0.1 (`--local-addr`), so that the
  ranks' shared store is there too;
- a rank that hosts a store of its own for a loopback address (a live resize's, the torch
  engine's, the calibration's) binds it the same way (`keep_stores_on_loopback`).

A server is bound by creating the socket here, bound to 127.0.0.1, and handing it to the store
(`master_listen_fd`, which the store then listens on).
"""

from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta

import torch.distributed as dist

from pipectl.artifacts.run import is_loopback_address

LOOPBACK = "127.0.0.1"
_ORIGINAL = dist.TCPStore


def loopback_listener(port: int) -> tuple[int, int]:
    """A TCP socket bound to 127.0.0.1:`port` (0: a free one), as (file descriptor, port); the
    caller owns the descriptor (a store closes it with itself)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((LOOPBACK, port))
    except OSError:
        listener.close()
        raise RuntimeError("The server socket has failed to listen on any local network address.") from None
    bound = listener.getsockname()[1]
    return listener.detach(), bound


class LoopbackTCPStore(_ORIGINAL):
    """A `TCPStore` whose server, when it serves a loopback address, listens on 127.0.0.1 only."""

    def __init__(
        self,
        host_name: str,
        port: int,
        world_size: int | None = None,
        is_master: bool = False,
        timeout: timedelta = timedelta(seconds=300),
        wait_for_workers: bool = True,
        multi_tenant: bool = False,
        master_listen_fd: int | None = None,
        use_libuv: bool = True,
    ) -> None:
        if is_master and master_listen_fd is None and is_loopback_address(host_name):
            master_listen_fd, port = loopback_listener(port)
        super().__init__(
            host_name, port, world_size, is_master, timeout, wait_for_workers, multi_tenant, master_listen_fd, use_libuv
        )


def keep_stores_on_loopback() -> None:
    """Make every store server this process creates for a loopback address bind 127.0.0.1 only:
    `torch.distributed.TCPStore`, and the name in each torch.distributed module that imported it,
    becomes `LoopbackTCPStore` (modules imported later take it from `torch.distributed`)."""
    dist.TCPStore = LoopbackTCPStore
    for name, module in list(sys.modules.items()):
        if name.startswith("torch.distributed") and getattr(module, "TCPStore", None) is _ORIGINAL:
            module.TCPStore = LoopbackTCPStore


if __name__ == "__main__":
    keep_stores_on_loopback()
    # torchrun's log folder holds nothing here (the ranks' output goes to the launch's log, and no
    # rank writes torchelastic's error file); without one, every launch left an empty
    # /tmp/torchelastic_* tree behind. os.devnull is torchrun's own "no log folder".
    os.environ.setdefault("PET_LOG_DIR", os.devnull)
    from torch.distributed.run import main

    main()
