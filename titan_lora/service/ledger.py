"""Who owns what, and the order requests run in: sessions and models per API key, and each model's requests
queued by `seq_id` (the SDK numbers a training client's calls 1, 2, 3, ... and may send the next before the
last finished, the chunks of one call even first-chunk-last), so a model's calls run in the order made.

A session ends when its client closes it (`/sessions/<id>/finish`) or stops sending heartbeats (the SDK
beats every 10 s; the cookbook's loops never close): its models are then released, their slots free again.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field

from titan_lora.service.slots import SlotSpec


RESEND_WINDOW = 1024
"""A model's last calls whose request ids are kept, so that the SDK's resend of one gets the same future."""


class RequestError(ValueError):
    """A request refused at once (HTTP 4xx with this message): `status` is its code."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Op:
    """One call to run on the trainer: `kind` (forward_backward, optim_step, save_state, load_state, create,
    release, restore_sampler), its model ("" for a reload), its request id (the future it finishes) and its
    decoded arguments."""

    kind: str
    model_id: str
    request_id: str
    args: object = None


@dataclass
class Model:
    """A training client: its owner, session, slot, adapter spec and the queue of its calls by seq_id."""

    key: str
    session: str
    slot: int
    spec: SlotSpec
    created: bool = False
    released: bool = False
    next_seq: int = 1
    queued: dict[int, Op] = field(default_factory=dict)
    requests: dict[int, str] = field(default_factory=dict)  # seq_id -> its request id (a resend gets it again)


@dataclass
class Session:
    """A client session: its key and when it was last heard from."""

    key: str
    seen: float


class Ledger:
    """Sessions, models and queues, shared by the HTTP routes (which add) and the worker (which takes)."""

    def __init__(self, slots: int, session_timeout_s: float = 120.0, per_key: int = 0) -> None:
        """`per_key`: the training clients one API key may hold at once (0: as many as there are slots)."""
        self._lock = threading.Condition()
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, Model] = {}
        self._free = list(range(slots))
        self._slots = slots
        self._unordered: list[Op] = []  # creates and releases: no seq_id
        self.session_timeout_s = session_timeout_s
        self.per_key = per_key or slots
        self.closed = False

    def new_session(self, key: str) -> str:
        """A session for `key`."""
        session = uuid.uuid4().hex[:16]
        with self._lock:
            self.sessions[session] = Session(key, time.monotonic())
        return session

    def own_session(self, session: str, key: str) -> None:
        """Raise unless `session` is a live session of `key`; it counts as heard from."""
        with self._lock:
            found = self.sessions.get(session)
            if found is None or found.key != key:
                raise RequestError(f"session {session!r} is not a live session of this API key", 404)
            found.seen = time.monotonic()

    def model(self, model_id: str, key: str) -> Model:
        """`key`'s model `model_id` (another key's is refused as unknown: it is never served)."""
        with self._lock:
            model = self.models.get(model_id)
            if model is None or model.key != key or model.released:
                raise RequestError(f"model {model_id!r} is not one of this API key's models", 404)
            if model.session in self.sessions:
                self.sessions[model.session].seen = time.monotonic()
            return model

    def create(self, key: str, session: str, model_id: str, spec: SlotSpec, request_id: str,
               args: object = None) -> Model:
        """A new model for `key` on a free slot, its create queued (refused when every slot is taken)."""
        with self._lock:
            if model_id in self.models:
                raise RequestError(f"model {model_id!r} exists already", 409)
            held = sum(1 for m in self.models.values() if m.key == key and not m.released)
            if held >= self.per_key:
                raise RequestError(f"this API key holds {held} training clients ([service] max_adapters_per_key = "
                                   f"{self.per_key}): close one's ServiceClient first")
            if not self._free:
                raise RequestError(f"every adapter slot is taken ([service] max_adapters = {self._slots}); close "
                                   "a training client's ServiceClient, or restart the service with more")
            model = Model(key, session, self._free.pop(0), spec)
            self.models[model_id] = model
            self._unordered.append(Op("create", model_id, request_id, args))
            self._lock.notify_all()
            return model

    def borrow(self, request_id: str, path: str, key: str) -> None:
        """Queue the reload of `key`'s saved sampler weights `path` into the engine through a free slot, which
        the worker gives back (`give_back`) once they are published (refused when every slot is taken)."""
        with self._lock:
            if not self._free:
                raise RequestError(f"every adapter slot is taken ([service] max_adapters = {self._slots}), and "
                                   f"reloading {path} into the engine needs one for a moment: try again later")
            self._unordered.append(Op("restore_sampler", "", request_id, (path, key, self._free.pop(0))))
            self._lock.notify_all()

    def give_back(self, slot: int) -> None:
        """A slot borrowed for a reload is free again."""
        with self._lock:
            if slot not in self._free:
                self._free.append(slot)

    def sent(self, model_id: str, seq_id: int) -> str | None:
        """The request id of call `seq_id` of the model if it was sent already (None: it was not)."""
        with self._lock:
            return self.models[model_id].requests.get(seq_id)

    def submit(self, model_id: str, seq_id: int, op: Op) -> str:
        """Queue `op` as call `seq_id` of its model; its request id, or the first one's when the SDK sends the
        same seq_id again (its retry after a lost answer): the call runs once."""
        with self._lock:
            model = self.models[model_id]
            if seq_id in model.requests:
                return model.requests[seq_id]
            if seq_id < model.next_seq:  # older than the resend window
                raise RequestError(f"seq_id {seq_id} of model {model_id!r} is behind its next call "
                                   f"({model.next_seq}): a training client numbers its calls 1, 2, 3, ...")
            model.requests[seq_id] = op.request_id
            model.queued[seq_id] = op
            self._lock.notify_all()
            return op.request_id

    def finish_session(self, session: str, key: str) -> None:
        """End `key`'s session now: its models are released."""
        self.own_session(session, key)
        with self._lock:
            self._end(session)

    def _end(self, session: str) -> None:
        self.sessions.pop(session, None)
        for model_id, model in self.models.items():
            if model.session == session and not model.released:
                model.released = True
                self._unordered.append(Op("release", model_id, ""))
        self._lock.notify_all()

    def take(self, timeout_s: float) -> list[Op]:
        """The calls that can run now (creates, releases, and each model's next call in seq_id order), waiting
        up to `timeout_s` for one; each model's turn advances when it is taken. Sessions silent for
        `session_timeout_s` end here."""
        with self._lock:
            self._lock.wait_for(lambda: self.closed or self._ready(), timeout_s)
            now = time.monotonic()
            for session in [s for s, info in self.sessions.items() if now - info.seen > self.session_timeout_s]:
                self._end(session)
            ops, self._unordered = self._unordered, []
            for model in self.models.values():
                op = model.queued.pop(model.next_seq, None) if model.created and not model.released else None
                if op is not None:
                    model.next_seq += 1
                    model.requests.pop(model.next_seq - RESEND_WINDOW, None)  # too old to be resent: bounded
                    ops.append(op)
            return ops

    def _ready(self) -> bool:
        return bool(self._unordered) or any(m.created and not m.released and m.next_seq in m.queued
                                            for m in self.models.values())

    def created(self, model_id: str) -> None:
        """The model's create ran: its calls may run."""
        with self._lock:
            self.models[model_id].created = True
            self._lock.notify_all()

    def forget(self, model_id: str) -> list[Op]:
        """Remove a model (released, or its create failed) and free its slot; the calls it still had queued."""
        with self._lock:
            model = self.models.pop(model_id, None)
            if model is None:
                return []
            self._free.append(model.slot)
            return list(model.queued.values())

    def close(self) -> None:
        """Wake the worker to stop."""
        with self._lock:
            self.closed = True
            self._lock.notify_all()
