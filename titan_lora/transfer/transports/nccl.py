"""NCCL: buckets sent over a process group between trainer rank 0 and the engine's workers, any host.

The way vLLM's NCCL weight-transfer engine and SGLang's `init_weights_update_group` do it: the trainer
publishes an address (the descriptor's host and port); each engine worker connects there once per
engine incarnation and joins a process group of its own, world = 1 + the engine's workers (trainer
rank 0, worker r rank 1 + r), built from a TCPStore the trainer hosts and constructed directly
(`ProcessGroupNCCL` / `ProcessGroupGloo`), apart from the trainer's default process group. The group
runs NCCL for CUDA buffers and gloo for CPU ones: the same code, which is how it is tested on CPU.

The engine still asks for each bucket (buffer id, token, byte range) over its join connection; the
trainer checks the request as the tcp server does (`TcpRefused` for an unknown buffer, a wrong token, a
range past the end), replies, and sends the range to that worker's rank over the group. The worker
receives it into its own slab on its device (the engine's, or one `BufferCache.lease` lends: never
storage the trainer reuses), then the copy-out, checksum and ack are those of every transport. An
engine of one worker gets each bucket by a broadcast in its group of two (NCCL runs a collective over
all its channels, a send/recv pair over a few); the workers of a larger engine each get theirs by send/recv. Asking keeps the
`/titan/bucket` route and the worker RPCs unchanged, keeps concurrent buckets in order (one at a time
per worker) and turns a refusal into words instead of a hung collective.

Every wait is bounded: joining (`JOIN_TIMEOUT_S`), one send or receive (`SEND_TIMEOUT_S`, the CPU
polls the work, since an NCCL wait only orders streams). A group whose peer failed, timed out or hung
up is abandoned (aborted) on both sides, and the worker's next bucket joins a new one. An engine that
restarts joins anew (its connections close; the trainer drops the old group). The engine receives
from one trainer host only, the first that served it.

Control wire format, big-endian. Request: MAGIC, op (u8: J join, F fetch), buffer id (16 bytes), token
(16 bytes), a (u64), b (u64), key (16 bytes). Join: a = the worker's rank in its engine, b = the
engine's worker count, key = the engine incarnation's (its workers share it). Fetch: a = offset,
b = nbytes. Reply: MAGIC, status (u8: 0 ok, 1 refused), length (u64), then `length` bytes: a join's
JSON {store_port, group, rank, world, backend}; nothing for a fetch (the bytes follow over the group);
a refusal's reason (UTF-8).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import itertools
import json
import logging
import secrets
import socket
import struct
import threading
import time

import torch
import torch.distributed as dist

from titan_lora.transfer.transports.base import Fetcher, Transport
from titan_lora.transfer.transports.tcp import _BucketServer, TcpBuffer
from titan_lora.transfer.transports.wire import (
    _REPLY, _address, _hex16, _keepalive, _left, _recv_exact, _settimeout, ended, read_reply, TcpRefused,
)

MAGIC = b"TLN1"
_REQUEST = struct.Struct("!4sc16s16sQQ16s")
_JOIN, _FETCH = b"J", b"F"
_OK, _REFUSED = 0, 1
BACKENDS = {"cuda": "nccl", "cpu": "gloo"}
"""The group's backend by the buffer's device type: gloo is the CPU fallback."""
JOIN_TIMEOUT_S = 60.0
"""The bound on forming a group: every member joined, the communicator connected."""
SEND_TIMEOUT_S = 60.0
"""The bound on one bucket's send (trainer) or receive (engine) over the group."""

logger = logging.getLogger("titan_lora.nccl")


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def backend_for(device: torch.device, backend: str = "") -> str:
    """The group backend for buffers on `device`; `backend` (nccl | gloo, empty: by the device) must fit it."""
    fits = BACKENDS.get(device.type)
    if fits is None:
        raise ValueError(f"nccl buffers live on cuda (NCCL) or cpu (gloo), not {device.type}")
    if backend and backend != fits:
        if backend == "nccl":
            raise ValueError(f"transport nccl with backend nccl sends GPU memory, but the trainer's device is "
                             f"{device}: on a CPU trainer set [engine] nccl_backend = \"gloo\" (the same group "
                             "over gloo) or use transport \"tcp\"")
        raise ValueError(f"the gloo fallback of transport nccl carries CPU buffers, but the trainer's device is "
                         f"{device}: set [engine] nccl_backend = \"nccl\" on a GPU trainer")
    return fits


def new_group(backend: str, store: dist.Store, name: str, rank: int, world: int, address: str) -> dist.ProcessGroup:
    """A process group of its own (not torch.distributed's world), `rank` of `world`, that meets in
    `store` under `name`; gloo binds `address` (this side's end of the route to the peer)."""
    prefixed = dist.PrefixStore(f"titan_lora/{name}/", store)
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = _timedelta(JOIN_TIMEOUT_S)
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
        return dist.ProcessGroupGloo(prefixed, rank, world, options)
    options = dist.ProcessGroupNCCL.Options()
    # Beyond our own bounds: we abort a group before its watchdog would (which tears the process down).
    options._timeout = _timedelta(4 * (JOIN_TIMEOUT_S + SEND_TIMEOUT_S))
    return dist.ProcessGroupNCCL(prefixed, rank, world, options)


def abandon(pg: dist.ProcessGroup | None) -> None:
    """Abort a group whose peer failed, so nothing waits on it (NCCL kernels included)."""
    if pg is None:
        return
    try:
        pg.abort()
    except RuntimeError as err:  # a backend without abort, or one already torn down
        logger.debug("abort of an abandoned group: %s", err)


def _done(work: dist.Work, deadline: float, what: str, cuda: bool) -> None:
    """Wait for `work` on the CPU until `deadline`. An NCCL wait without a bound only orders streams, so
    the CPU polls the work; with a bound it would poll in sleeps of milliseconds, a sync's whole budget."""
    try:
        if cuda:
            work.wait()
        else:
            work.wait(_timedelta(max(deadline - time.monotonic(), 1e-3)))
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {what} did not complete within {SEND_TIMEOUT_S:.0f} s")
            time.sleep(0)
    except RuntimeError as err:  # gloo: the peer hung up or the wait timed out
        raise ConnectionError(f"the {what} failed: {err}") from None


def _move(pg: dist.ProcessGroup, world: int, tensor: torch.Tensor, worker: int, sending: bool) -> dist.Work:
    """Move `tensor` from the trainer (rank 0) to `worker`: a broadcast when the group is the two of them,
    since NCCL spreads a collective over all its channels and a send/recv pair over a few; else p2p."""
    if world == 2:  # a collective's bound is given when it is issued (gloo ignores the wait's)
        return pg.broadcast(tensor, 0, _timedelta(SEND_TIMEOUT_S))
    return pg.send([tensor], worker, 0) if sending else pg.recv([tensor], 0, 0)


@dataclasses.dataclass
class _Group:
    """One engine incarnation's group, trainer side: who joined, and its communicator once formed."""

    name: str
    world: int  # 1 + the engine's workers
    members: set[int] = dataclasses.field(default_factory=set)
    pg: dist.ProcessGroup | None = None
    failed: str = ""
    ready: threading.Event = dataclasses.field(default_factory=threading.Event)
    send_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)  # NCCL p2p: one thread

    def fail(self, why: str) -> None:
        """Abandon the group: members still asking are refused and join a new one."""
        if not self.failed:
            self.failed = why
            logger.warning("nccl group %s abandoned: %s", self.name, why)
        self.ready.set()
        abandon(self.pg)


class _Hub(_BucketServer):
    """The trainer's nccl hub on one address: buffers by id and token (as the tcp server keeps them), a
    TCPStore for the groups to meet in, and one group per engine incarnation. A connection authenticates
    with its join (a served buffer's id and token), within `tcp.AUTH_TIMEOUT_S`, as the tcp server's do."""

    magic = MAGIC
    what = "nccl hub"

    def __init__(self, host: str, port: int) -> None:
        self.backend = ""  # set by the first buffer: one hub, one backend
        self._groups: dict[bytes, _Group] = {}
        self._names = itertools.count()
        self.store: dist.TCPStore | None = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                   timeout=_timedelta(JOIN_TIMEOUT_S))
        super().__init__(host, port)  # serves from here on

    def join(self, key: bytes, rank: int, world: int) -> tuple[_Group, int]:
        """The group of engine incarnation `key` that worker `rank` of `world` joins, and its rank there;
        the trainer forms its side once all of them joined."""
        if not 0 <= rank < world <= 1024:
            raise TcpRefused(f"worker rank {rank} of {world} is not a place in an engine")
        with self._lock:
            group = self._groups.get(key)
            if group is None or group.failed or rank + 1 in group.members:  # new, or a rejoin after a fault
                group = self._groups[key] = _Group(f"g{next(self._names)}-{secrets.token_hex(4)}", world + 1)
            if group.world != world + 1:
                raise TcpRefused(f"this engine joined with {group.world - 1} workers, not {world}")
            group.members.add(rank + 1)
            full = len(group.members) == world
        if full:
            threading.Thread(target=self._form, args=(group,), name=f"titan-nccl-{group.name}", daemon=True).start()
        return group, rank + 1

    def _form(self, group: _Group) -> None:
        store = self.store
        if store is None:
            group.fail("the trainer's nccl hub stopped")
            return
        try:
            group.pg = new_group(self.backend, store, group.name, 0, group.world, self.host)
        except RuntimeError as err:
            group.fail(f"the group did not form: {err}")
            return
        group.ready.set()

    def leave(self, group: _Group, why: str) -> None:
        """A member's connection ended: its engine died or restarted, so the group goes."""
        with self._lock:
            self._groups = {k: g for k, g in self._groups.items() if g is not group}
        group.fail(why)

    def stop(self, join_s: float = 1.0) -> None:
        """Stop serving, abandon every group."""
        super().stop(join_s)
        with self._lock:
            groups, self._groups = list(self._groups.values()), {}
        for group in groups:
            group.fail("the trainer's nccl hub stopped")
        self.store = None  # its listening socket and connections close now, not when the hub is collected


class _HubHandler:
    """One engine worker's connection: a join, then its fetches, until it hangs up."""

    def __init__(self, request: socket.socket, client_address: tuple, server: _Hub) -> None:
        self.request, self.server = request, server
        self.group: _Group | None = None  # once joined
        _keepalive(request)
        try:
            self._serve()
        except (OSError, TcpRefused) as err:
            logger.warning("nccl hub %s:%d: worker at %s: %s", server.host, server.port, client_address, err)
        finally:
            if self.group is not None:
                server.leave(self.group, f"worker connection from {client_address} ended")

    def _read(self, deadline: float | None) -> tuple | None:
        """The next request; None when the peer closed. `deadline`: the whole request's (a join's); else a
        member idles between syncs without one (keepalive ends a dead peer), then has `SEND_TIMEOUT_S`
        for the rest of a request once its first byte came."""
        head = memoryview(bytearray(_REQUEST.size))
        got = 0
        self.request.settimeout(None if deadline is None else _left(deadline))
        while got < len(head):
            n = self.request.recv_into(head[got:])
            if n == 0:
                return None
            if deadline is None:
                deadline = time.monotonic() + SEND_TIMEOUT_S
            got += n
            self.request.settimeout(_left(deadline))
        fields = _REQUEST.unpack(head)
        if fields[0] != MAGIC:
            raise TcpRefused("not a titan_lora nccl request")
        return fields[1:]

    def _reply(self, status: int, body: bytes = b"", length: int | None = None) -> None:
        self.request.sendall(_REPLY.pack(MAGIC, status, len(body) if length is None else length) + body)

    def _refuse(self, err: TcpRefused) -> None:
        self._reply(_REFUSED, str(err).encode())

    def _serve(self) -> None:
        try:
            request = self._read(self.server.auth_deadline())
        except TimeoutError:
            self.server.farewell(self.request, timed_out=True)
            return
        if request is None:
            self.server.farewell(self.request, timed_out=False)
            return
        op, buffer_id, token, rank, world, key = request
        self.request.settimeout(SEND_TIMEOUT_S)
        try:
            if op != _JOIN:
                raise TcpRefused("a worker joins before it fetches")
            self.server.view(buffer_id, token, 0, 0)  # only a holder of a descriptor joins
            self.server.admit()
            store = self.server.store
            if store is None:
                raise TcpRefused("the trainer's nccl hub stopped")
            group, member = self.server.join(key, rank, world)
        except TcpRefused as err:
            self._refuse(err)
            return
        self.group = group
        self._reply(_OK, json.dumps({"store_port": store.port, "group": group.name, "rank": member,
                                     "world": group.world, "backend": self.server.backend}).encode())
        while (request := self._read(None)) is not None:
            op, buffer_id, token, offset, nbytes, _ = request
            try:
                if op != _FETCH:
                    raise TcpRefused("already joined: only fetches follow")
                view = self.server.view(buffer_id, token, offset, nbytes)
                if not group.ready.wait(JOIN_TIMEOUT_S):
                    group.fail(f"not every worker joined within {JOIN_TIMEOUT_S:.0f} s")
                if group.failed:
                    raise TcpRefused(f"the group is gone ({group.failed}): join again")
            except TcpRefused as err:
                self._refuse(err)
                continue
            self._reply(_OK, length=nbytes)
            self._send(group, member, view)

    def _send(self, group: _Group, member: int, view: torch.Tensor) -> None:
        with group.send_lock:
            if view.is_cuda:  # NCCL issues on the current device; the trainer may hold several
                torch.cuda.set_device(view.device)
            _done(_move(group.pg, group.world, view, member, sending=True), time.monotonic() + SEND_TIMEOUT_S,
                  f"send of {view.numel()} bytes to worker rank {member}", view.is_cuda)


_Hub.handler = _HubHandler


class NcclBuffer(TcpBuffer):
    """Trainer side: memory on its device (CUDA: NCCL; CPU: the gloo fallback), handed out by this
    process's nccl hub, which checks each request as the tcp server does and sends over the group."""

    kind = "nccl"
    server_class = _Hub

    def __init__(self, size: int, device: torch.device, *, host: str = "127.0.0.1", port: int = 0,
                 backend: str = "") -> None:
        self.backend = backend_for(device, backend)
        super().__init__(size, device, host=host, port=port)
        hub = self._server
        if hub.backend and hub.backend != self.backend:
            self.close()
            raise ValueError(f"the nccl hub on {host}:{port} sends {hub.backend} buffers, not {self.backend}: "
                             "give buffers on another device another port")
        hub.backend = self.backend

    def _fields(self) -> dict:
        return {**super()._fields(), "backend": self.backend}


@dataclasses.dataclass
class _Link:
    """One engine worker's membership in a trainer's group: the connection it asks on, and the group."""

    sock: socket.socket
    pg: dist.ProcessGroup
    device: torch.device
    world: int
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def close(self) -> None:
        """Leave the group (the trainer abandons it when the connection ends)."""
        abandon(self.pg)
        self.sock.close()

    def ended(self) -> bool:
        """Whether the trainer hung up (or sent what was not asked for); hold `lock`."""
        return ended(self.sock)


class NcclFetcher(Fetcher):
    """Engine side: joins the trainer's group once per trainer address, then asks for each bucket and
    receives it over the group into the slab the engine lends, on its own device.

    A plain engine process is one worker (`join_as` is how a vLLM worker says which of several it is)."""

    def __init__(self) -> None:
        self._member = (0, 1, secrets.token_bytes(16))  # a process of its own: one incarnation
        self._links: dict[tuple[str, int], _Link] = {}
        self._lock = threading.Lock()
        self.trainer_host: str | None = None

    def join_as(self, rank: int, world: int, incarnation: str) -> None:
        """Join groups as worker `rank` of `world` of the engine incarnation named `incarnation`, which
        all its workers name alike."""
        self._member = (rank, world, hashlib.blake2b(incarnation.encode(), digest_size=16).digest())

    def device(self, desc: dict) -> torch.device:
        """This worker's GPU for an NCCL group; the host for gloo."""
        backend = desc.get("backend")
        if backend == "gloo":
            return torch.device("cpu")
        if backend != "nccl":
            raise ValueError(f"nccl descriptor names backend {backend!r}: nccl or gloo")
        if not torch.cuda.is_available():
            raise ValueError("the trainer sends over NCCL but this engine has no CUDA device: run the engine on "
                             "a GPU, or use transport \"tcp\" (the gloo fallback is for a CPU trainer)")
        return torch.device("cuda", torch.cuda.current_device())

    def fetch(self, desc: dict, offset: int, into: torch.Tensor) -> None:
        """The buffer's bytes [offset, offset + into.numel()) received into `into`, or an error saying why not."""
        addr = _address(desc)
        buffer_id, token = _hex16(desc, "id"), _hex16(desc, "token")
        size, nbytes = desc.get("size"), into.numel()
        if not isinstance(size, int) or offset < 0 or offset + nbytes > size:
            raise ValueError(f"a bucket of {nbytes} bytes at offset {offset} does not fit in the nccl buffer "
                             f"of {size!r} bytes it names")
        if self.trainer_host is not None and addr[0] != self.trainer_host:
            raise ValueError(f"nccl descriptor names trainer host {addr[0]!r}, but this engine receives only "
                             f"from {self.trainer_host!r}, the first trainer that served it: restart the engine "
                             "to serve another trainer")
        if into.device != self.device(desc) or not into.is_contiguous():
            raise ValueError(f"nccl receives into a contiguous slab on {self.device(desc)}, not {into.device}")
        deadline = time.monotonic() + JOIN_TIMEOUT_S + SEND_TIMEOUT_S
        link = self._link(addr, desc, buffer_id, token, deadline)
        with link.lock:
            try:
                _settimeout(link.sock, deadline)
                link.sock.sendall(_REQUEST.pack(MAGIC, _FETCH, buffer_id, token, offset, nbytes, bytes(16)))
                _answer(link.sock, addr, deadline, expect=nbytes)
                _done(_move(link.pg, link.world, into, 0, sending=False), time.monotonic() + SEND_TIMEOUT_S,
                      f"receive of {nbytes} bytes from the trainer at {addr[0]}:{addr[1]}", into.is_cuda)
            except TcpRefused as err:
                if "join again" in str(err):
                    self._drop(addr, link)
                raise
            except BaseException:
                self._drop(addr, link)  # out of step with the trainer: the next bucket joins anew
                raise
        self.trainer_host = self.trainer_host or addr[0]

    def _link(self, addr: tuple[str, int], desc: dict, buffer_id: bytes, token: bytes, deadline: float) -> _Link:
        """This worker's group with the hub at `addr`, joined on first use. First every link no fetch will
        use again is left: one to another address (an earlier trainer run: on GPU each holds an NCCL
        communicator) and one whose connection reads EOF (its trainer went)."""
        with self._lock:
            for other, link in list(self._links.items()):
                if not link.lock.acquire(blocking=False):
                    continue  # in use: a fetch that fails on it drops it itself
                try:
                    if other != addr or link.ended():
                        del self._links[other]
                        link.close()
                finally:
                    link.lock.release()
            link = self._links.get(addr)
            if link is None:
                link = self._links[addr] = self._join(addr, desc, buffer_id, token, deadline)
            return link

    def _drop(self, addr: tuple[str, int], link: _Link) -> None:
        with self._lock:
            if self._links.get(addr) is link:
                del self._links[addr]
        link.close()

    def _join(self, addr: tuple[str, int], desc: dict, buffer_id: bytes, token: bytes, deadline: float) -> _Link:
        rank, world, key = self._member
        device = self.device(desc)
        try:
            sock = socket.create_connection(addr, timeout=max(0.0, deadline - time.monotonic()))
        except OSError as err:
            raise ConnectionError(f"cannot reach the trainer's nccl hub at {addr[0]}:{addr[1]} ({err}): it must "
                                  "advertise an address this engine can reach ([engine] tcp_host)") from None
        try:
            _keepalive(sock)
            sock.sendall(_REQUEST.pack(MAGIC, _JOIN, buffer_id, token, rank, world, key))
            joined = json.loads(_answer(sock, addr, deadline))
            store = dist.TCPStore(addr[0], joined["store_port"], is_master=False,
                                  timeout=_timedelta(max(1.0, deadline - time.monotonic())))
            if device.type == "cuda":
                torch.cuda.set_device(device)
            pg = new_group(joined["backend"], store, joined["group"], joined["rank"], joined["world"],
                           sock.getsockname()[0])
        except BaseException:
            sock.close()
            raise
        logger.info("joined nccl group %s as rank %d of %d (%s) with the trainer at %s:%d", joined["group"],
                    joined["rank"], joined["world"], joined["backend"], *addr)
        return _Link(sock, pg, device, joined["world"])

    def close(self) -> None:
        """Leave every group (the engine shuts down)."""
        with self._lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.close()


def _answer(sock: socket.socket, addr: tuple[str, int], deadline: float, expect: int | None = None) -> bytes:
    """The hub's reply: a join's body, or (`expect`: a fetch's byte count) nothing, the bytes follow over
    the group; TcpRefused with its reason when the hub said no."""
    length = read_reply(sock, addr, deadline, MAGIC, "nccl hub")
    if expect is not None:
        if length != expect:
            raise ConnectionError(f"{addr[0]}:{addr[1]} announced {length} bytes, {expect} were asked")
        return b""
    if length > 1 << 16:
        raise ConnectionError(f"{addr[0]}:{addr[1]} sent a join reply of {length} bytes")
    body = memoryview(bytearray(length))
    _recv_exact(sock, body, addr, "join reply", deadline)
    return bytes(body)


NCCL = Transport(NcclBuffer, NcclFetcher())
