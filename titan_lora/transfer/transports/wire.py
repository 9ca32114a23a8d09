"""The wire both network transports share (tcp's bucket server and the nccl hub): the reply header,
refusals, descriptor fields, socket options and bounded reads."""

from __future__ import annotations

import socket
import struct
import time

_REPLY = struct.Struct("!4sBQ")
_OK, _REFUSED = 0, 1


class TcpRefused(ValueError):
    """The trainer's bucket server refused a request (unknown buffer, wrong token, range past the end)."""

    def __init__(self, message: str, *, whole: bool = True) -> None:
        super().__init__(message)
        self.whole = whole  # the engine read the whole refusal: its connection is still in step


def _keepalive(sock: socket.socket) -> None:
    """No Nagle delay; keepalive probes so that a peer gone without a FIN (half-open) is noticed."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, option):  # Linux; elsewhere the system's keepalive timing applies
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def _left(deadline: float) -> float:
    """Seconds to `deadline`, as a socket timeout (a past one still times the next read out at once)."""
    return max(deadline - time.monotonic(), 1e-3)


def _hex16(desc: dict, key: str) -> bytes:
    value = desc.get(key)
    try:
        raw = bytes.fromhex(value) if isinstance(value, str) else b""
    except ValueError:
        raw = b""
    if len(raw) != 16:
        raise ValueError(f"tcp descriptor field {key!r} must be 32 hex digits, got {value!r}")
    return raw


def _address(desc: dict) -> tuple[str, int]:
    host, port = desc.get("host"), desc.get("port")
    if not isinstance(host, str) or not host or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"tcp descriptor names no address: host {host!r}, port {port!r}")
    return host, port


def ended(sock: socket.socket) -> bool:
    """Whether an idle connection is done for: the peer closed it (EOF), reset it, or sent what nobody
    asked for (out of step). Reads nothing, never blocks."""
    try:
        sock.settimeout(0)  # each use sets its own timeout again
        sock.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return False  # nothing to read: alive and in step
    except OSError:
        return True
    return True


class _Stale(ConnectionError):
    """A kept-alive connection closed before any reply byte: try a fresh one."""


def _settimeout(sock: socket.socket, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the tcp bucket fetch ran out of time")
    sock.settimeout(left)


def read_reply(sock: socket.socket, addr: tuple[str, int], deadline: float, magic: bytes, server: str,
               stale_if_empty: bool = False) -> int:
    """The length a reply header announces, once it proved to come from `server` and say yes; a refusal
    raises TcpRefused with the server's reason."""
    head = memoryview(bytearray(_REPLY.size))
    _recv_exact(sock, head, addr, "reply header", deadline, stale_if_empty=stale_if_empty)
    got, status, length = _REPLY.unpack(head)
    if got != magic:
        raise ConnectionError(f"{addr[0]}:{addr[1]} is not a titan_lora {server}")
    if status != _OK:
        why = memoryview(bytearray(min(length, 4096)))
        _recv_exact(sock, why, addr, "refusal", deadline)
        raise TcpRefused(f"the trainer's {server} refused: {bytes(why).decode(errors='replace')}",
                         whole=length <= len(why))
    return length


def _recv_exact(sock: socket.socket, out: memoryview, addr: tuple[str, int], what: str, deadline: float,
                stale_if_empty: bool = False) -> None:
    """Fill `out` from `sock` before `deadline`; a short read, a timeout or a socket error raises."""
    got = 0
    while got < len(out):
        try:
            _settimeout(sock, deadline)
            n = sock.recv_into(out[got:])
        except TimeoutError:
            raise TimeoutError(f"the trainer's tcp bucket server at {addr[0]}:{addr[1]} sent {got} of "
                               f"{len(out)} bytes of the {what} in time") from None
        except OSError as err:
            if stale_if_empty and got == 0:
                raise _Stale(f"{addr[0]}:{addr[1]}: {err}") from None
            raise ConnectionError(f"short read: {got} of {len(out)} bytes of the {what} from "
                                  f"{addr[0]}:{addr[1]} ({err})") from None
        if n == 0:
            if stale_if_empty and got == 0:
                raise _Stale(f"{addr[0]}:{addr[1]} closed the connection before replying")
            raise ConnectionError(f"short read: {got} of {len(out)} bytes of the {what} from "
                                  f"{addr[0]}:{addr[1]} (the connection closed)")
        got += n
