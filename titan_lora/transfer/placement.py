"""Which transport carries the buckets to an engine, from where the engine is (`[engine] transport`).

"auto" keeps the device's default (shm on CPU, cuda_ipc on GPU) for an engine on this host, which
maps the trainer's memory, and takes tcp for an engine elsewhere, which cannot. An engine is on this
host when its URL names a loopback address or one this host can bind. An engine on this host that
still cannot see its memory (another container without --ipc=host) refuses the segment; name
`transport = "tcp"` for it.
"""

from __future__ import annotations

import ipaddress
import socket
import urllib.parse

from titan_lora.transfer.transport import TransportChoice
from titan_lora.transfer.transports.base import transport_named

AUTO = "auto"
REMOTE_DEFAULT = "tcp"
"""The transport "auto" takes for an engine on another host."""


def _host(url: str) -> str:
    return urllib.parse.urlsplit(url).hostname or ""


def _addresses(host: str) -> set[str]:
    try:
        return {info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except OSError:  # unresolvable here: not this host's name
        return set()


def _bindable(address: str) -> bool:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((address, 0))
        except OSError:
            return False
    return True


def is_loopback_url(url: str) -> bool:
    """Whether `url` names this host through a loopback address (or names no host)."""
    host = _host(url)
    return not host or any(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in _addresses(host))


def is_local_url(url: str) -> bool:
    """Whether `url` names this host: a loopback address, or one this host can bind."""
    return is_loopback_url(url) or any(_bindable(a) for a in _addresses(_host(url)))


def route_address(url: str) -> str:
    """This host's address on the route to `url`'s host, as that host sees it (no packet is sent)."""
    host = _host(url)
    addresses = sorted(_addresses(host))
    if not addresses:
        raise ValueError(f"cannot resolve the engine host {host!r} to pick the address the trainer serves "
                         "tcp buckets on: set [engine] tcp_host")
    family = socket.AF_INET6 if ":" in addresses[0] else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((addresses[0], 9))  # a UDP connect only picks the route
        except OSError as err:
            raise ValueError(f"no route from this host to the engine host {host!r} ({err}) to pick the "
                             "address the trainer serves tcp buckets on: set [engine] tcp_host") from None
        return sock.getsockname()[0]


def transport_kind(name: str, engine_url: str) -> str | None:
    """The transport `[engine] transport = name` selects for an engine at `engine_url` ("": one this
    process starts); None: the buffer device's default. An unknown name raises, listing the known ones."""
    if name == AUTO:
        return REMOTE_DEFAULT if engine_url and not is_local_url(engine_url) else None
    return transport_named(name).kind


def choose_transport(name: str, engine_url: str, serve_host: str = "", serve_port: int = 0,
                     nccl_backend: str = "") -> TransportChoice:
    """The trainer's bucket transport for an engine at `engine_url`. A network transport serves on
    `serve_host:serve_port`; an empty host is 127.0.0.1 for an engine on loopback, else this host's
    address on the route to the engine. nccl's group runs `nccl_backend` (empty: by the buffer's device)."""
    kind = transport_kind(name, engine_url)
    if kind is None or not transport_named(kind).buffer.network:
        return TransportChoice(kind)
    host = serve_host or ("127.0.0.1" if is_loopback_url(engine_url) else route_address(engine_url))
    backend = (("backend", nccl_backend),) if kind == "nccl" and nccl_backend else ()
    return TransportChoice(kind, (("host", host), ("port", serve_port), *backend))
