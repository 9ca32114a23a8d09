"""How the syncer gives an engine our base: verified by digest where the engine loaded one itself, the
tensors that differ or the whole base streamed otherwise (`[weight_sync] base`; docs/internals.md, "The base:
verified, not pushed"). A mixin of `WeightSyncer`: it uses the syncer's collective helpers and state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from titan_lora.clients.base import VerifiesBase, verify_ack
from titan_lora.sync.retries import backoff
from titan_lora.transfer.errors import TransferError
from titan_lora.transfer.protocol import Ack

if TYPE_CHECKING:
    from titan_lora.sync.base_stream import BaseStream

logger = logging.getLogger("titan_lora.sync.syncer")


class BaseTally:
    """Counts what passes through the base stream (rank 0), to check the engine's ack against it."""

    def __init__(self, stream: Iterator[tuple[str, torch.Tensor]]) -> None:
        self._stream = stream
        self.tensors = 0
        self.nbytes = 0

    def __iter__(self) -> BaseTally:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        name, tensor = next(self._stream)
        self.tensors += 1
        self.nbytes += tensor.numel() * tensor.element_size()
        return name, tensor

    def drain(self) -> None:
        """Run the rest of the stream: every `next()` is a collective the other ranks take part in."""
        for _ in self:
            pass


class BaseGiving:
    """`WeightSyncer`'s base: `_ensure_base` once per engine incarnation, `_give_base` for revived replicas."""

    base_weights: BaseStream
    base_digests: Callable[[torch.dtype | None], dict[str, str]] | None
    _our_digests: dict[str, dict[str, str]]
    _remember: dict | None

    def _ensure_base(self, version: int) -> None:
        """Collective: give the base to this engine incarnation when it has not got ours."""
        # The answer rides on the outcome's broadcast: one control message, not two, every sync.
        needed = self._rank0(lambda: self._incarnation() != self._base_incarnation, "reaching the engine",
                             share_value=True)
        if needed:
            self._give_base(version)

    def _give_base(self, version: int, whole: bool = True) -> None:
        """Collective: verify the base the engine loaded itself, sending only the tensors whose digests
        differ, or send it whole where the engine cannot verify (`[weight_sync] base`). `whole`: the engine
        (every replica) is a new incarnation; else only revived replicas lack our base."""
        record = None
        if self.base_digests is not None:
            record = self._rank0(lambda: self.emitter.base_digests() if isinstance(self.emitter, VerifiesBase)
                                 else None, "reading the engine's base digests", share_value=True)
        if record is None:  # cannot verify ([weight_sync] base = "push", SGLang, the receiver)
            self._send_base(version, whole=whole)
            return
        started = time.perf_counter()
        ours = self.our_base_digests(record["dtype"])
        self._remember = {"dtype": record["dtype"], "digests": ours}  # for a replica's revival (rank 0)
        differ = sorted(n for n, d in ours.items() if record["digests"].get(n) != d)  # same on every rank
        if differ:
            if record["digests"]:
                logger.warning("the engine's own base differs from ours in %d of %d tensors (e.g. %s): sending "
                               "those", len(differ), len(ours), ", ".join(differ[:3]))
            partial = bool(record["digests"]) and len(differ) < len(ours)  # none loaded: the whole base
            self._send_base(version, only=differ if partial else None, whole=whole)
            return
        self._rank0(lambda: self._adopt_base(version, whole), "recording the verified base")
        self.counters["base_verified"] += 1
        ms = (time.perf_counter() - started) * 1e3
        logger.info("verified the engine's own base: %d tensors, every digest equal; nothing sent (%.1f s)",
                    len(ours), ms / 1e3)
        self._base_ms = ms

    def our_base_digests(self, dtype: str | None) -> dict[str, str]:
        """Collective: the trainer's base digests in `dtype` (the engine's), computed once per dtype."""
        key = dtype or ""
        if key not in self._our_digests:
            self._our_digests[key] = self.base_digests(getattr(torch, dtype) if dtype else None)
        return self._our_digests[key]

    def _adopt_base(self, version: int, whole: bool) -> None:
        """Rank 0: the engine's own base is ours: record it there and here, as a base send would."""
        self.emitter.remember_base_digests(self._remember, version)
        self.emitter.adopt_base(version)
        self._took_base(whole)

    def _took_base(self, whole: bool) -> None:
        """Rank 0: the engine holds our base now; a new incarnation (`whole`) holds none of our adapters."""
        if whole:
            self.forget_versions()
            self._base_incarnation = self._incarnation()

    def _send_base(self, version: int, only: list[str] | None = None, whole: bool = True) -> None:
        """Collective: stream the base (or the tensors `only` names, the engine completing the rest from its own
        checkpoint); a failed attempt re-runs the whole stream on every rank."""
        for attempt in range(self.cfg.retries + 1):
            started = time.perf_counter()
            tally = BaseTally(self.base_weights() if only is None else self.base_weights(set(only)))
            try:
                send = self._watched(lambda: self._stream_base(tally, version, only), "sending the base")
                ack = self._rank0(send, "sending the base", then=tally.drain)
            except TransferError as err:  # raised on every rank alike
                if attempt == self.cfg.retries:
                    raise TransferError(f"sending the base failed after {attempt + 1} attempts: {err}") \
                        from err
                logger.warning("sending the base failed (%s); retrying", err)
                backoff(attempt)
                continue
            self._after_base(ack, tally, version, started, whole)
            return
        raise AssertionError("unreachable")

    def _stream_base(self, tally: BaseTally, version: int, only: list[str] | None) -> Ack:
        """Rank 0: the stream to the engine: whole, or the tensors `only` names (it reads the rest itself)."""
        if self._remember is not None:
            self.emitter.remember_base_digests(self._remember, version)
        if only is None:
            return self.emitter.send_base(tally, version)
        return self.emitter.send_base_part(tally, version)

    def _after_base(self, ack: Ack | None, tally: BaseTally, version: int, started: float, whole: bool) -> None:
        def verify() -> None:
            verify_ack(ack, version, tally.tensors, tally.nbytes, "base weights")
            self._took_base(whole)

        self._rank0(verify, "checking the base's acknowledgement")
        self.counters["base_sends"] += 1
        ms = (time.perf_counter() - started) * 1e3
        logger.info("sent the base weights (%d tensors) in %.1f s", tally.tensors, ms / 1e3)
        self._base_ms = ms  # reported by the sync it belongs to, also when a recovery sent it
