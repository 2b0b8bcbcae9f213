"""A loopback-only rendezvous for single-node jobs, plugged into torchrun (`--rdzv-backend labkit-loopback`).

Why: `torchrun --standalone` hosts its TCPStore on ALL interfaces, unauthenticated; on workshop
Wi-Fi anyone could reach it (seen with `ss -ltnp`: the agent's store LISTENs on `*:port`). This
handler is torchrun's own c10d rendezvous with both of its stores (the rendezvous store and the store it shares with the
workers) bound to 127.0.0.1 through a socket the kit binds itself (`TCPStore(master_listen_fd=)`),
on a port the OS chooses. gloo's listeners follow `GLOO_SOCKET_IFNAME=lo`, set by the launcher.

torchrun finds the handler through the `torchrun.handlers` entry point declared in pyproject.toml.
Multi-node jobs cannot be loopback-only; they use torchrun's static rendezvous on the endpoint given
(node 0 hosts it; see `labkit.launching.command.torchrun_command`).
"""

from __future__ import annotations

import socket
from datetime import timedelta

BACKEND_NAME = "labkit-loopback"
_SOCKETS: list[socket.socket] = []  # the stores listen on these: keep them open for the agent's life


def loopback_store(port: int = 0, timeout_s: int = 60):
    """A TCPStore server listening on 127.0.0.1 only (port 0: the OS chooses)."""
    from torch.distributed import TCPStore

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(1024)
    _SOCKETS.append(sock)
    return TCPStore("127.0.0.1", sock.getsockname()[1], is_master=True, multi_tenant=True,
                    master_listen_fd=sock.fileno(), timeout=timedelta(seconds=timeout_s))


def create_loopback_handler(params):
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    from ..versions import keep_store_on_loopback

    class LoopbackBackend(C10dRendezvousBackend):
        @property
        def name(self) -> str:  # torchrun checks it against --rdzv-backend
            return BACKEND_NAME

    timeout = int(params.get_as_int("read_timeout", 60) or 60)
    store = loopback_store(0, timeout)
    handler = create_handler(store, LoopbackBackend(store, params.run_id), params)
    # The store shared with the workers: also loopback-only (torch creates it on every interface).
    if not keep_store_on_loopback(handler, lambda addr, port: loopback_store(port, timeout)):
        raise RuntimeError(
            "This torch's rendezvous handler has no _create_tcp_store_server: the kit cannot keep the "
            "workers' store on loopback. Set LABKIT_RDZV=standalone to use torchrun --standalone instead."
        )
    return handler


def handler_generator():
    """Entry point for torchrun's plugin registry (`torchrun.handlers`): returns the handler factory."""
    return create_loopback_handler
