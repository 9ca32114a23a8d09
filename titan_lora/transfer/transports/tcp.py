"""TCP: buckets pulled over a socket from the trainer's memory, for an engine on any host.

The trainer side runs one small server thread per address it serves on (rank 0 alone holds buffers)
that hands out byte ranges of its registered buffers. A descriptor names the address, the buffer's id,
an unguessable per-buffer token (only a process that was handed the descriptor can read the buffer)
and its size. The engine side connects (connections are kept and reused), asks for the bucket's range
and receives it straight into its host slab (`recv_into`); the trainer sends from the tensor's own
memory, a CUDA buffer through one fixed pinned staging buffer per server. The bytes are fetched per
bucket, so the engine holds no copy that a later bucket could be served from. The engine fetches from
one trainer host only (the first that served it). Nothing is encrypted: use tcp on a private network.

Wire format, big-endian. Request: MAGIC, buffer id (16 bytes), token (16 bytes), offset (u64),
nbytes (u64). Reply: MAGIC, status (u8: 0 ok, 1 refused), length (u64), then `length` bytes: the range,
or why it was refused (UTF-8). A connection that sends anything else is dropped.
"""

from __future__ import annotations

import atexit
import hmac
import logging
import secrets
import socket
import sys
import socketserver
import struct
import threading
import time
from typing import ClassVar

import torch

from titan_lora.transfer.transports.base import BucketBuffer, Fetcher, Transport

MAGIC = b"TLB1"
_REQUEST = struct.Struct("!4s16s16sQQ")
_REPLY = struct.Struct("!4sBQ")
_OK, _REFUSED = 0, 1
FETCH_TIMEOUT_S = 60.0
"""The engine's bound on one fetch, connecting included."""
SEND_TIMEOUT_S = 60.0
"""The trainer's bound on sending one range to an engine that stopped reading."""
MAX_FETCH_BYTES = 1 << 34
"""The largest range one request may ask for (16 GiB): a bucket, never a whole model's worth more."""
IDLE_KEPT = 8  # idle connections an engine keeps per trainer address
MAX_CONNECTIONS = 64
"""Connections the trainer serves at once (engines x TP workers x concurrent buckets); more are refused."""
IDLE_TIMEOUT_S = 300.0
"""The trainer closes a connection idle this long between requests (the engine reconnects)."""
HEADER_TIMEOUT_S = 10.0
"""The trainer's bound on receiving the rest of a request header once its first byte came."""
STAGING_BYTES = 16 << 20
"""The trainer's one pinned host buffer per server that CUDA ranges are sent through, chunk by chunk."""

logger = logging.getLogger("titan_lora.tcp")


class TcpRefused(ValueError):
    """The trainer's bucket server refused a request (unknown buffer, wrong token, range past the end)."""

    def __init__(self, message: str, *, whole: bool = True) -> None:
        super().__init__(message)
        self.whole = whole  # the engine read the whole refusal: its connection is still in step


class _BucketServer(socketserver.ThreadingTCPServer):
    """The trainer's bucket server on one address: registered buffers by id, each with its token.

    It runs inside rank 0's training process, so nothing an engine (or anyone) does may hold it: at most
    `MAX_CONNECTIONS` connections at once (more are refused), a request header must arrive within
    `HEADER_TIMEOUT_S` once begun and an idle connection goes after `IDLE_TIMEOUT_S`, keepalive probes
    end half-open ones, and CUDA ranges go through one fixed-size pinned staging buffer."""

    daemon_threads = True
    allow_reuse_address = True
    handler: ClassVar[type[socketserver.BaseRequestHandler]]
    """What serves one connection (`_Handler`, set below; the nccl hub has its own)."""

    # The listen backlog: connections past it wait on SYN retransmits (seconds) before they are even
    # accepted or refused; every connection the cap admits, and as many again to refuse, fit in it.
    request_queue_size = 2 * MAX_CONNECTIONS

    def __init__(self, host: str, port: int) -> None:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
        self.address_family = family  # IPv6 when the host is one
        super().__init__(address, self.handler)
        self.host = host
        self._buffers: dict[bytes, tuple[bytes, torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._handlers: dict[threading.Thread, socket.socket] = {}
        self._staging: torch.Tensor | None = None
        self.owners = 0  # open TcpBuffers on this server, under _SERVERS_LOCK: it stops with the last
        self.staging_lock = threading.Lock()
        threading.Thread(target=self.serve_forever, name=f"titan-tcp-buckets-{self.port}", daemon=True).start()

    def handle_error(self, request: socket.socket, client_address: tuple) -> None:
        """One line, not a traceback: an engine that timed out or restarted drops its connection."""
        logger.warning("tcp bucket server %s:%d: connection from %s ended: %r", self.host, self.port,
                       client_address, sys.exc_info()[1])

    def process_request(self, request: socket.socket, client_address: tuple) -> None:
        """A handler thread for the connection, or a refusal past `MAX_CONNECTIONS`."""
        with self._lock:
            full = len(self._handlers) >= MAX_CONNECTIONS
            if not full:
                thread = threading.Thread(target=self.process_request_thread, args=(request, client_address),
                                          daemon=True)
                self._handlers[thread] = request
        if full:
            logger.warning("tcp bucket server %s:%d: refused %s: %d connections are open already",
                           self.host, self.port, client_address, MAX_CONNECTIONS)
            why = f"the trainer's tcp bucket server has {MAX_CONNECTIONS} connections open already".encode()
            try:
                request.settimeout(0)
                request.send(_REPLY.pack(MAGIC, _REFUSED, len(why)) + why)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        thread.start()

    def process_request_thread(self, request: socket.socket, client_address: tuple) -> None:
        """Serve one connection, then forget its thread."""
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                self._handlers.pop(threading.current_thread(), None)

    @property
    def port(self) -> int:
        """The port it listens on (chosen by the OS when 0 was asked)."""
        return self.server_address[1]

    def add(self, buffer_id: bytes, token: bytes, tensor: torch.Tensor) -> None:
        """Serve `tensor`'s bytes to requests that name `buffer_id` with `token`."""
        with self._lock:
            self._buffers[buffer_id] = (token, tensor)

    def remove(self, buffer_id: bytes) -> None:
        """Serve this buffer no more."""
        with self._lock:
            self._buffers.pop(buffer_id, None)

    def view(self, buffer_id: bytes, token: bytes, offset: int, nbytes: int) -> torch.Tensor:
        """The bytes [offset, offset + nbytes) of a registered buffer; TcpRefused otherwise."""
        with self._lock:
            found = self._buffers.get(buffer_id)
        if found is None:
            raise TcpRefused(f"no buffer {buffer_id.hex()} is served here (freed, or the trainer restarted)")
        want, tensor = found
        if not hmac.compare_digest(want, token):
            raise TcpRefused(f"wrong token for buffer {buffer_id.hex()}")
        if nbytes > MAX_FETCH_BYTES or offset + nbytes > tensor.numel():
            raise TcpRefused(f"bytes [{offset}, {offset + nbytes}) are past the end of buffer "
                             f"{buffer_id.hex()} ({tensor.numel()} bytes)")
        return tensor[offset : offset + nbytes]

    def staging(self) -> torch.Tensor:
        """The server's one pinned host buffer for CUDA ranges (`STAGING_BYTES`); hold `staging_lock`."""
        if self._staging is None:
            self._staging = _pinned(STAGING_BYTES)
        return self._staging

    def stop(self, join_s: float = 1.0) -> None:
        """Stop listening, end every connection and give handler threads `join_s` to finish."""
        self.shutdown()
        self.server_close()
        with self._lock:
            handlers = dict(self._handlers)
        for sock in handlers.values():
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes a handler waiting for a request or mid-send
            except OSError:
                pass
        deadline = time.monotonic() + join_s
        for thread in handlers:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._staging = None


def _pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _keepalive(sock: socket.socket) -> None:
    """No Nagle delay; keepalive probes so that a peer gone without a FIN (half-open) is noticed."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, option):  # Linux; elsewhere the system's keepalive timing applies
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


class _Handler(socketserver.BaseRequestHandler):
    """One engine connection: requests in turn until it closes, idles too long or stalls mid-header."""

    server: _BucketServer

    def handle(self) -> None:
        _keepalive(self.request)
        while (head := self._read_request()) is not None:
            magic, buffer_id, token, offset, nbytes = _REQUEST.unpack(head)
            if magic != MAGIC:
                return
            self.request.settimeout(SEND_TIMEOUT_S)
            try:
                view = self.server.view(buffer_id, token, offset, nbytes)
            except TcpRefused as err:
                why = str(err).encode()
                self.request.sendall(_REPLY.pack(MAGIC, _REFUSED, len(why)) + why)
                continue
            self.request.sendall(_REPLY.pack(MAGIC, _OK, nbytes))
            self._send(view)

    def _read_request(self) -> bytes | None:
        """The next request header; None when the engine closed, idled past `IDLE_TIMEOUT_S` (it
        reconnects) or took longer than `HEADER_TIMEOUT_S` over one header."""
        head = bytearray()
        try:
            self.request.settimeout(IDLE_TIMEOUT_S)
            while len(head) < _REQUEST.size:
                chunk = self.request.recv(_REQUEST.size - len(head))
                if not chunk:
                    return None
                if not head:
                    deadline = time.monotonic() + HEADER_TIMEOUT_S
                head += chunk
                self.request.settimeout(max(deadline - time.monotonic(), 1e-3))
        except TimeoutError:
            return None
        return bytes(head)

    def _send(self, view: torch.Tensor) -> None:
        """A host range straight from its memory; a CUDA one in `STAGING_BYTES` chunks through the
        server's one pinned staging buffer, so pinned memory never grows with buckets or connections."""
        if not _needs_staging(view):
            self.request.sendall(memoryview(view.numpy()))
            return
        for start in range(0, view.numel(), STAGING_BYTES):
            chunk = view[start : start + STAGING_BYTES]
            with self.server.staging_lock:
                staged = self.server.staging()[: chunk.numel()].copy_(chunk)
                self.request.sendall(memoryview(staged.numpy()))


def _needs_staging(view: torch.Tensor) -> bool:
    return view.is_cuda


_BucketServer.handler = _Handler
_SERVERS: dict[tuple[type[_BucketServer], str, int], _BucketServer] = {}
_SERVERS_LOCK = threading.Lock()


def serving(host: str, port: int, cls: type[_BucketServer] = _BucketServer) -> _BucketServer:
    """This process's bucket server of class `cls` on `host:port` (port 0: one on a free port), started
    on first use. Hold `_SERVERS_LOCK` until a buffer is added, so that a last buffer's close cannot stop
    it between."""
    server = _SERVERS.get((cls, host, port))
    if server is None:
        try:
            server = _SERVERS[(cls, host, port)] = cls(host, port)
        except OSError as err:
            raise OSError(f"cannot serve buckets on {host}:{port} ({err}): set [engine] tcp_host to "
                          "an address of this host that the engine can reach, and tcp_port to a free "
                          "port (0: any)") from err
    return server


def _release(server: _BucketServer) -> None:
    """A buffer of `server` was closed: stop the server with its last one, so no port stays bound."""
    with _SERVERS_LOCK:
        server.owners -= 1
        if server.owners > 0:
            return
        for key, found in list(_SERVERS.items()):
            if found is server:
                del _SERVERS[key]
    server.stop()


@atexit.register
def _stop_all() -> None:
    """At exit, no handler thread may still be copying from a buffer the interpreter is tearing down."""
    with _SERVERS_LOCK:
        servers = set(_SERVERS.values())
        _SERVERS.clear()
    for server in servers:
        server.stop()


class TcpBuffer(BucketBuffer):
    """Trainer side: plain memory on its device, served by this process's bucket server."""

    kind = "tcp"
    network = True
    server_class: ClassVar[type[_BucketServer]] = _BucketServer
    """The server that hands this buffer's bytes out (the nccl transport's sends them over its group)."""

    def __init__(self, size: int, device: torch.device, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self._id, self._token = secrets.token_bytes(16), secrets.token_bytes(16)
        with _SERVERS_LOCK:
            self._server = serving(host, port, self.server_class)
            super().__init__(size, device)
            self._server.add(self._id, self._token, self.tensor)
            self._server.owners += 1

    def _allocate(self) -> torch.Tensor:
        return torch.empty(self.size, dtype=torch.uint8, device=self.device)

    def _fields(self) -> dict:
        return {"host": self._server.host, "port": self._server.port, "id": self._id.hex(),
                "token": self._token.hex(), "size": self.size}

    def unlink(self) -> None:
        """Serve this buffer no more."""
        self._server.remove(self._id)

    def close(self) -> None:
        """Release the buffer; the server stops when its last buffer is closed."""
        super().close()
        _release(self._server)


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


class TcpFetcher(Fetcher):
    """Engine side: asks the trainer's bucket server for each bucket, over kept-alive connections.

    It fetches from one trainer host only: the first that served it a bucket (pinned for the life of
    the engine process), so that a descriptor cannot make the engine dial any other host."""

    def __init__(self, timeout_s: float = FETCH_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._idle: dict[tuple[str, int], list[socket.socket]] = {}
        self._lock = threading.Lock()
        self.trainer_host: str | None = None

    def fetch(self, desc: dict, offset: int, into: torch.Tensor) -> None:
        """The buffer's bytes [offset, offset + into.numel()) into `into`, or an error saying why not."""
        addr = _address(desc)
        buffer_id, token = _hex16(desc, "id"), _hex16(desc, "token")
        size, nbytes = desc.get("size"), into.numel()
        if not isinstance(size, int) or offset < 0 or nbytes > MAX_FETCH_BYTES or offset + nbytes > size:
            raise ValueError(f"a bucket of {nbytes} bytes at offset {offset} does not fit in the tcp buffer "
                             f"of {size!r} bytes it names (at most {MAX_FETCH_BYTES} bytes per bucket)")
        pinned = self.trainer_host
        if pinned is not None and addr[0] != pinned:
            raise ValueError(f"tcp descriptor names trainer host {addr[0]!r}, but this engine fetches only "
                             f"from {pinned!r}, the first trainer that served it: restart the engine to "
                             "serve another trainer")
        request = _REQUEST.pack(MAGIC, buffer_id, token, offset, nbytes)
        out = memoryview(into.numpy()).cast("B")
        deadline = time.monotonic() + self.timeout_s
        sock = self._take(addr)
        try:
            if sock is None:
                raise _Stale("no kept connection")
            self._ask(sock, addr, request, out, deadline)  # kept alive: the server may have closed it since
        except _Stale:
            self._ask(self._connect(addr, deadline), addr, request, out, deadline)
        with self._lock:
            self.trainer_host = self.trainer_host or addr[0]

    def _take(self, addr: tuple[str, int]) -> socket.socket | None:
        with self._lock:
            idle = self._idle.get(addr)
            return idle.pop() if idle else None

    def _keep(self, addr: tuple[str, int], sock: socket.socket) -> None:
        with self._lock:
            idle = self._idle.setdefault(addr, [])
            if len(idle) < IDLE_KEPT:
                idle.append(sock)
                return
        sock.close()

    def _connect(self, addr: tuple[str, int], deadline: float) -> socket.socket:
        try:
            sock = socket.create_connection(addr, timeout=max(0.0, deadline - time.monotonic()))
        except OSError as err:
            raise ConnectionError(f"cannot reach the trainer's tcp bucket server at {addr[0]}:{addr[1]} "
                                  f"({err}): it must advertise an address this engine can reach "
                                  "([engine] tcp_host)") from None
        _keepalive(sock)
        return sock

    def _ask(self, sock: socket.socket, addr: tuple[str, int], request: bytes, out: memoryview,
             deadline: float) -> None:
        """One request on `sock`; kept for reuse after a complete reply, closed after anything else."""
        try:
            try:
                _settimeout(sock, deadline)
                sock.sendall(request)
            except TimeoutError:
                raise TimeoutError(f"the trainer's tcp bucket server at {addr[0]}:{addr[1]} took no request "
                                   "in time") from None
            except OSError as err:
                raise _Stale(f"{addr[0]}:{addr[1]} closed the connection ({err})") from None
            length = read_reply(sock, addr, deadline, MAGIC, "tcp bucket server", stale_if_empty=True)
            if length != len(out):
                raise ConnectionError(f"{addr[0]}:{addr[1]} announced {length} bytes, {len(out)} were asked")
            _recv_exact(sock, out, addr, "bucket", deadline)
        except TcpRefused as err:
            if err.whole:  # the reply was read whole: the connection is still in step
                self._keep(addr, sock)
            else:
                sock.close()
            raise
        except BaseException:
            sock.close()
            raise
        self._keep(addr, sock)


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


TCP = Transport(TcpBuffer, TcpFetcher())
