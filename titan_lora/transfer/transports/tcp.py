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
or why it was refused (UTF-8). A connection that sends anything else is dropped, and so is one that has not
authenticated (sent a request naming a served buffer with its token) within `AUTH_TIMEOUT_S` of
connecting: only authenticated connections hold one of the server's `MAX_CONNECTIONS` slots.
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
from titan_lora.transfer.transports.wire import (  # TcpRefused, _REPLY: this transport's API
    _OK, _REFUSED, _REPLY, _address, _hex16, _keepalive, _left, _recv_exact, _settimeout, _Stale, ended,
    read_reply, TcpRefused,
)

MAGIC = b"TLB1"
_REQUEST = struct.Struct("!4s16s16sQQ")
FETCH_TIMEOUT_S = 60.0
"""The engine's bound on one fetch, connecting included."""
SEND_TIMEOUT_S = 60.0
"""The trainer's bound on sending one range to an engine that stopped reading."""
MAX_FETCH_BYTES = 1 << 34
"""The largest range one request may ask for (16 GiB): a bucket, never a whole model's worth more."""
IDLE_KEPT = 8  # idle connections an engine keeps per trainer address
MAX_CONNECTIONS = 64
"""Authenticated connections the trainer serves at once (engines x TP workers x concurrent buckets);
a connection that authenticates past them is refused."""
AUTH_TIMEOUT_S = 5.0
"""A new connection's bound on authenticating: its first request naming a served buffer with its token
(an engine sends it as soon as it connects). One that does not is told why and closed."""
MAX_PENDING = 64
"""Connections not yet authenticated held at once; a new one past them evicts the oldest, so that
silent or keyless peers never hold a slot an engine needs."""
IDLE_TIMEOUT_S = 300.0
"""The trainer closes a connection idle this long between requests (the engine reconnects)."""
HEADER_TIMEOUT_S = 10.0
"""The trainer's bound on receiving the rest of a request header once its first byte came."""
STAGING_BYTES = 16 << 20
"""The trainer's one pinned host buffer per server that CUDA ranges are sent through, chunk by chunk."""

logger = logging.getLogger("titan_lora.tcp")


class _BucketServer(socketserver.ThreadingTCPServer):
    """The trainer's bucket server on one address: registered buffers by id, each with its token.

    It runs inside rank 0's training process, so nothing an engine (or anyone) does may hold it: a new
    connection must authenticate (a request naming a served buffer with its token) within
    `AUTH_TIMEOUT_S`, and at most `MAX_PENDING` wait to (a newer one evicts the oldest); at most
    `MAX_CONNECTIONS` authenticated ones are served (more are refused); a request header must arrive
    within `HEADER_TIMEOUT_S` once begun and an idle connection goes after `IDLE_TIMEOUT_S`, keepalive
    probes end half-open ones, and CUDA ranges go through one fixed-size pinned staging buffer."""

    daemon_threads = True
    allow_reuse_address = True
    handler: ClassVar[type[socketserver.BaseRequestHandler]]
    """What serves one connection (`_Handler`, set below; the nccl hub has its own)."""
    magic: ClassVar[bytes] = MAGIC
    """The magic of its replies, refusals included (the nccl hub has its own)."""
    what: ClassVar[str] = "tcp bucket server"
    """What it is called in its refusals and logs."""

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
        self._handlers: dict[threading.Thread, socket.socket] = {}  # every connection's
        self._pending: dict[threading.Thread, socket.socket] = {}  # not yet authenticated, oldest first
        self._admitted: set[threading.Thread] = set()
        self._evicted: set[threading.Thread] = set()
        self._staging: torch.Tensor | None = None
        self.owners = 0  # open TcpBuffers on this server, under _SERVERS_LOCK: it stops with the last
        self.staging_lock = threading.Lock()
        threading.Thread(target=self.serve_forever, name=f"titan-tcp-buckets-{self.port}", daemon=True).start()

    def handle_error(self, request: socket.socket, client_address: tuple) -> None:
        """One line, not a traceback: an engine that timed out or restarted drops its connection."""
        logger.warning("%s %s:%d: connection from %s ended: %r", self.what, self.host, self.port,
                       client_address, sys.exc_info()[1])

    def process_request(self, request: socket.socket, client_address: tuple) -> None:
        """A handler thread for the connection, pending until it authenticates (`admit`); past
        `MAX_PENDING` pending connections the oldest is evicted (its handler says so and ends)."""
        thread = threading.Thread(target=self.process_request_thread, args=(request, client_address), daemon=True)
        evicted = None
        with self._lock:
            self._handlers[thread] = self._pending[thread] = request
            if len(self._pending) > MAX_PENDING:
                oldest = next(iter(self._pending))  # insertion order is age
                evicted = self._pending.pop(oldest)
                self._evicted.add(oldest)
        if evicted is not None:
            logger.warning("%s %s:%d: evicted a connection that did not authenticate: %d newer ones wait",
                           self.what, self.host, self.port, MAX_PENDING)
            try:
                evicted.shutdown(socket.SHUT_RD)  # its handler's read returns: it says why and ends
            except OSError:
                pass
        thread.start()

    def process_request_thread(self, request: socket.socket, client_address: tuple) -> None:
        """Serve one connection, then forget its thread."""
        try:
            super().process_request_thread(request, client_address)
        finally:
            me = threading.current_thread()
            with self._lock:
                self._handlers.pop(me, None)
                self._pending.pop(me, None)
                self._admitted.discard(me)
                self._evicted.discard(me)

    @staticmethod
    def auth_deadline() -> float:
        """When a connection accepted now must have authenticated (`AUTH_TIMEOUT_S`)."""
        return time.monotonic() + AUTH_TIMEOUT_S

    def admit(self) -> None:
        """The calling handler's connection named a served buffer with its token: count it against
        `MAX_CONNECTIONS` from now on; TcpRefused when that many are authenticated already."""
        me = threading.current_thread()
        with self._lock:
            if me in self._admitted:
                return
            if len(self._admitted) >= MAX_CONNECTIONS:
                raise TcpRefused(f"the trainer's {self.what} serves {MAX_CONNECTIONS} authenticated "
                                 "connections already (engines x TP workers x concurrent buckets): "
                                 "retry once a transfer ended, or serve fewer engines from one trainer")
            self._pending.pop(me, None)
            self._evicted.discard(me)
            self._admitted.add(me)

    def farewell(self, sock: socket.socket, timed_out: bool) -> None:
        """Tell a connection that never authenticated why it is closed (evicted, or out of time); best
        effort, never blocking: the peer may not read."""
        with self._lock:
            evicted = threading.current_thread() in self._evicted
        if evicted:
            why = (f"the trainer's {self.what} dropped this connection: it sent no valid request while "
                   f"{MAX_PENDING} newer connections waited to authenticate")
        elif timed_out:
            why = (f"the trainer's {self.what} dropped this connection: no request naming a served buffer "
                   f"and its token within {AUTH_TIMEOUT_S:g} s of connecting")
        else:
            return
        try:
            sock.settimeout(0)
            sock.send(_REPLY.pack(self.magic, _REFUSED, len(why.encode())) + why.encode())
        except OSError:
            pass

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


class _Handler(socketserver.BaseRequestHandler):
    """One engine connection: requests in turn until it closes, idles too long or stalls mid-header."""

    server: _BucketServer

    def handle(self) -> None:
        _keepalive(self.request)
        self.deadline: float | None = self.server.auth_deadline()  # None once authenticated
        try:
            while (head := self._read_request()) is not None:
                magic, buffer_id, token, offset, nbytes = _REQUEST.unpack(head)
                if magic != MAGIC:
                    return
                self.request.settimeout(SEND_TIMEOUT_S)
                try:
                    view = self.server.view(buffer_id, token, offset, nbytes)
                    if self.deadline is not None:
                        self.server.admit()
                        self.deadline = None
                except TcpRefused as err:
                    why = str(err).encode()
                    self.request.sendall(_REPLY.pack(MAGIC, _REFUSED, len(why)) + why)
                    continue
                self.request.sendall(_REPLY.pack(MAGIC, _OK, nbytes))
                self._send(view)
        except TimeoutError:
            if self.deadline is None:
                return  # an engine's connection idled or stalled: it reconnects
            self.server.farewell(self.request, timed_out=True)
            return
        if self.deadline is not None:
            self.server.farewell(self.request, timed_out=False)

    def _read_request(self) -> bytes | None:
        """The next request header; None when the engine closed or (authenticated) idled past
        `IDLE_TIMEOUT_S` (it reconnects) or took longer than `HEADER_TIMEOUT_S` over one header.
        Before it authenticated, every read ends at its deadline (TimeoutError)."""
        head = bytearray()
        deadline = self.deadline
        try:
            self.request.settimeout(IDLE_TIMEOUT_S if deadline is None else _left(deadline))
            while len(head) < _REQUEST.size:
                chunk = self.request.recv(_REQUEST.size - len(head))
                if not chunk:
                    return None
                if not head and deadline is None:
                    deadline = time.monotonic() + HEADER_TIMEOUT_S
                head += chunk
                self.request.settimeout(_left(deadline))
        except TimeoutError:
            if self.deadline is not None:
                raise
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
        """A kept connection to `addr`, if one is; first the ones no fetch will use again are closed:
        every connection to another address (an earlier trainer run) and every one that reads EOF."""
        with self._lock:
            gone = [sock for other, idle in self._idle.items() if other != addr for sock in idle]
            self._idle = {addr: self._idle.get(addr, [])}
            idle = self._idle[addr]
            gone += [sock for sock in idle if ended(sock)]
            idle[:] = [sock for sock in idle if sock not in gone]
            taken = idle.pop() if idle else None
        for sock in gone:
            sock.close()
        return taken

    def _keep(self, addr: tuple[str, int], sock: socket.socket) -> None:
        with self._lock:
            idle = self._idle.setdefault(addr, [])
            if len(idle) < IDLE_KEPT:
                idle.append(sock)
                return
        sock.close()

    def close(self) -> None:
        """Close every kept connection (the engine shuts down)."""
        with self._lock:
            idle, self._idle = self._idle, {}
        for socks in idle.values():
            for sock in socks:
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


TCP = Transport(TcpBuffer, TcpFetcher())
