"""The weight syncer: base once per engine incarnation, then the adapter after every optimizer step.

Every rank calls `sync` (it is collective: the gathers, and two small broadcasts that carry rank 0's
decisions and outcome, so that all ranks raise together instead of hanging). Only rank 0 talks to
the engine. A version is published for rollouts only after the engine acknowledged exactly what was
sent; non-finite adapters are never published.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from titan_lora.config import WeightSync
from titan_lora.emitters.base import Ack, Emitter, EmitterError, EngineLimits, EngineWeightsLost
from titan_lora.sync.adapter_source import AdapterSource
from titan_lora.sync.retire import Retirer
from titan_lora.sync.versions import AdapterVersions

if TYPE_CHECKING:
    from titan_lora.engines.launch import EmbeddedEngine
    from titan_lora.engines.rollout import RolloutClient
    from titan_lora.train import TrainingRun

logger = logging.getLogger(__name__)


def check_engine_limits(limits: EngineLimits, rank: int, targets: list[str], keep_versions: int) -> None:
    """Fail before training when the engine cannot serve our adapter or hold the retention window."""
    if rank > limits.max_lora_rank:
        raise EmitterError(
            f"[lora] rank = {rank} exceeds the engine's max LoRA rank {limits.max_lora_rank}; "
            f"restart the engine with --max-lora-rank >= {rank} or lower [lora] rank"
        )
    if limits.target_modules is not None:
        missing = sorted(set(targets) - limits.target_modules)
        if missing:
            raise EmitterError(
                f"the engine cannot apply LoRA to {missing} (it supports {sorted(limits.target_modules)}); "
                "narrow [lora] target_modules or restart the engine with those modules enabled"
            )
    if limits.max_loras < keep_versions + 1:  # the window, plus the version being loaded
        raise EmitterError(
            f"[weight_sync] keep_versions = {keep_versions} needs {keep_versions + 1} adapter slots but the "
            f"engine has {limits.max_loras}; restart it with --max-loras >= {keep_versions + 1}"
        )


def with_retries(fn: Callable[[], object], retries: int, what: str) -> object:
    """Call `fn`, retrying on EmitterError with capped exponential back-off; re-raise at the end."""
    for attempt in range(retries + 1):
        try:
            return fn()
        except EngineWeightsLost:
            raise  # retrying cannot help: the base has to go again first
        except EmitterError as err:
            if attempt == retries:
                raise EmitterError(f"{what} failed after {retries + 1} attempts: {err}") from err
            delay = min(2.0**attempt, 10.0)
            logger.warning("%s failed (%s); retrying in %.0f s", what, err, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


class WeightSyncer:
    """Keeps one engine on the newest adapter version."""

    def __init__(
        self,
        source: AdapterSource,
        base_weights: Callable[[], Mapping[str, torch.Tensor] | None],
        emitter: Emitter | None,
        cfg: WeightSync,
        device: torch.device,
        engine: EmbeddedEngine | None = None,
        rollouts: RolloutClient | None = None,
        probe: Callable[[str], dict[str, float]] | None = None,
    ) -> None:
        self.source = source
        self.base_weights = base_weights
        self.emitter = emitter  # rank 0 only
        self.cfg = cfg
        self.device = device
        self.engine = engine  # rank 0, when titan_lora started the engine itself
        self.rollouts = rollouts  # rank 0
        self.probe = probe
        self.versions = AdapterVersions(cfg.lora_name, cfg.keep_versions)
        self.retirer = Retirer(self.versions, emitter.retire_adapter, cfg.retire_timeout_s) if emitter else None
        self._base_incarnation: str | None = None
        self.counters = {"nonfinite_skipped": 0, "base_sends": 0, "syncs": 0}
        self.last_metrics: dict[str, float] = {}

    def check_engine(self) -> None:
        """Collective: rank 0 validates the engine's limits; every rank raises on a mismatch."""
        error = None
        if self.emitter is not None:
            try:
                limits = with_retries(self.emitter.engine_limits, self.cfg.retries, "reading the engine's limits")
                check_engine_limits(limits, self.source.rank, self.source.target_modules, self.cfg.keep_versions)
            except EmitterError as err:
                error = str(err)
        self._agree(error)

    def _agree(self, error: str | None) -> None:
        box = [error]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0)
        if box[0] is not None:
            raise EmitterError(box[0])

    def _needs_base(self) -> bool:
        """Rank 0's decision, shared with every rank: has this engine incarnation got our base?"""
        flag = torch.zeros(1, dtype=torch.int32, device=self.device)
        error = None
        if self.emitter is not None:
            try:
                if self.engine is not None:
                    self.engine.ensure_running()
                incarnation = with_retries(self.emitter.engine_incarnation, self.cfg.retries, "reaching the engine")
                flag[0] = int(incarnation != self._base_incarnation)
            except EmitterError as err:
                error = str(err)
        self._agree(error)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(flag, src=0)
        return bool(flag.item())

    def _send_base(self, version: int) -> dict[str, float]:
        started = time.perf_counter()
        tensors = self.base_weights()  # collective
        error, phases = None, {}
        if self.emitter is not None:
            try:
                ack = with_retries(lambda: self.emitter.send_base(tensors, version), self.cfg.retries, "sending the base")
                self._verify(ack, version, tensors, "base weights")
                self.versions.forget_all()  # a new incarnation holds none of our adapters
                self._base_incarnation = self.emitter.engine_incarnation()
                self.counters["base_sends"] += 1
                phases = {"base_ms": (time.perf_counter() - started) * 1e3}
                logger.info("sent the base weights (%d tensors) in %.1f s", ack.num_tensors, phases["base_ms"] / 1e3)
            except EmitterError as err:
                error = str(err)
        self._agree(error)
        return phases

    @staticmethod
    def _verify(ack: Ack, version: int, tensors: Mapping[str, torch.Tensor], what: str) -> None:
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if (ack.version, ack.num_tensors, ack.nbytes) != (version, len(tensors), nbytes):
            raise EmitterError(
                f"the engine acknowledged {what} as version {ack.version}, {ack.num_tensors} tensors, "
                f"{ack.nbytes} bytes; sent version {version}, {len(tensors)} tensors, {nbytes} bytes"
            )

    def sync(self, version: int) -> dict[str, float]:
        """Collective: bring the engine to adapter `version` (the training step)."""
        started = time.perf_counter()
        metrics: dict[str, float] = {}
        if self._needs_base():
            metrics |= self._send_base(version)
        t0 = time.perf_counter()
        payload = self.source.snapshot(version)  # collective
        metrics["gather_ms"] = (time.perf_counter() - t0) * 1e3
        error = None
        if self.emitter is not None and payload is not None:
            try:
                metrics |= self._emit(payload)
            except EmitterError as err:
                error = str(err)
        self._agree(error)
        metrics["total_ms"] = (time.perf_counter() - started) * 1e3
        if self.probe is not None and self.cfg.parity_every and self.counters["syncs"] % self.cfg.parity_every == 0:
            active = self.versions.active
            metrics |= self.probe(active.name if active else "")  # collective forward
        self.counters["syncs"] += 1
        self.last_metrics = {f"sync/{k}": float(v) for k, v in {**metrics, **self.counters}.items()}
        return self.last_metrics

    def _emit(self, payload) -> dict[str, float]:  # noqa: ANN001
        if not self.source.snapshot_is_finite():
            self.counters["nonfinite_skipped"] += 1
            logger.error("adapter version %d has NaN/Inf values: not published; version %s stays live",
                         payload.version, self.versions.active)
            return {"version": payload.version, "published": 0}
        if len(self.versions.live) > self.versions.keep_versions:
            # Retirements lag behind: give them a bounded chance, so live versions stay <= keep + 1.
            self.retirer.wait_idle(self.cfg.retire_timeout_s)
        try:
            ack = with_retries(lambda: self.emitter.send_adapter(payload), self.cfg.retries,
                               f"sending adapter {payload.name}")
        except EngineWeightsLost as err:
            self._base_incarnation = None  # the next sync sends the base first, then the newest adapter
            logger.error("engine lost its base weights (%s): version %d not published", err, payload.version)
            return {"version": payload.version, "published": 0}
        self._verify(ack, payload.version, payload.tensors, f"adapter {payload.name}")
        self.versions.publish(payload.version)
        self.retirer.schedule_expired()
        return {**ack.phases_ms, "version": payload.version, "published": 1, "bytes": ack.nbytes,
                "tensors": ack.num_tensors, "live_versions": len(self.versions.live),
                "retired": self.retirer.retired, "retire_failed": self.retirer.failed}

    def attach(self, optimizers, current_step: Callable[[], int]) -> None:  # noqa: ANN001
        """Sync after every optimizer step (torchtitan's optimizer container post-step hook)."""
        optimizers.register_step_post_hook(lambda *_args, **_kwargs: self.sync(current_step()))

    def close(self) -> None:
        """Stop the retirer and release the emitter."""
        if self.retirer is not None:
            self.retirer.close()
        if self.emitter is not None:
            self.emitter.close()
        if self.engine is not None:
            self.engine.stop()


def build_syncer(run: TrainingRun) -> WeightSyncer:
    """The syncer for `run`, its engine started or attached, limits checked, hooked to the optimizer."""
    from titan_lora.sync.wiring import wire_syncer

    return wire_syncer(run)
