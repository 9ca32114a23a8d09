"""The fakes behind the in-process WeightSyncer tests (test_syncer_sends.py, test_syncer_recovery.py,
test_syncer_publish.py): an adapter source, a base stream, an emitter and an engine that record every call,
a parity probe, the [weight_sync] config those tests use and the Rig a syncer is built into. The oracle of
those tests is the call log of the fake emitter and engine and the numbers the fakes were given (tensors,
bytes, versions), derived by hand; the `sleeps` and `rig` fixtures that build on these live in conftest.py.
"""

from __future__ import annotations

import dataclasses
import threading

import torch

from titan_lora.clients.base import AdapterPayload
from titan_lora.config import WeightSync
from titan_lora.sync.syncer import WeightSyncer
from titan_lora.sync.versions import versioned_name
from titan_lora.transfer.errors import EngineDied, EngineHung
from titan_lora.transfer.protocol import Ack, EngineLimits

# Two base tensors: 3*2*4 + 5*4 = 44 bytes. Two adapter tensors: 2*4*4 + 4*2*4 = 64 bytes.
BASE = [("model.embed_tokens.weight", torch.ones(3, 2)), ("model.norm.weight", torch.ones(5))]
BASE_BYTES, ADAPTER_BYTES = 44, 64


def cfg(**overrides) -> WeightSync:
    """[weight_sync] for these tests: one retry, two engine restarts, short timeouts."""
    base = WeightSync(enabled=True, retries=1, keep_versions=2, retire_timeout_s=5.0,
                      parity_every=0, health_timeout_s=2.0, engine_start_timeout_s=30.0, engine_restarts=2)
    return dataclasses.replace(base, **overrides)


class Source:
    """AdapterSource stand-in: version v's adapter holds the value v."""

    rank = 8
    target_modules = ["q_proj", "v_proj"]
    adapts_experts = False

    def __init__(self) -> None:
        self.finite = True
        self.snapshots: list[int] = []

    def snapshot(self, version: int) -> AdapterPayload:
        self.snapshots.append(version)
        tensors = {"m.q_proj.lora_A.weight": torch.full((2, 4), float(version)),
                   "m.q_proj.lora_B.weight": torch.zeros(4, 2)}
        return AdapterPayload(versioned_name("policy", version), version, tensors, {"r": 2}, finite=self.finite)


class Base:
    """The base stream: counts how often it was started and how many tensors were drawn from it."""

    def __init__(self) -> None:
        self.starts = 0
        self.drawn = 0

    def __call__(self, only=None):
        self.starts += 1
        for name, t in BASE:
            if only is not None and name not in only:
                continue
            self.drawn += 1
            yield name, t


class Emitter:
    """Records calls; `fail[method]` lists errors to raise on its next calls (None: succeed)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.incarnation = "inc-1"
        self.limits = EngineLimits(8, 3, frozenset({"q_proj", "v_proj"}))
        self.fail: dict[str, list[BaseException | None]] = {}
        self.adapter_ack = None  # payload -> Ack, to lie
        self.base_ack = None  # (version, tensors, bytes) -> Ack, to lie
        self.unload_answer = True
        self.unloaded: list[tuple[str, float]] = []
        self.wedged = False  # its core does not answer: check_live raises EngineHung
        self.live_checks = 0
        self.interrupts: list[str] = []
        self._interrupted = threading.Event()

    def check_live(self, timeout_s: float) -> None:
        self.live_checks += 1
        if self.wedged:
            raise EngineHung(f"no answer within {timeout_s} s (wedged)")

    def interrupt(self, reason: str) -> None:
        self.interrupts.append(reason)
        self._interrupted.set()

    def hang_until_interrupted(self, limit_s: float = 30.0) -> None:
        """What a request to a wedged engine does: wait for `interrupt` (then EngineHung), at most limit_s."""
        if not self._interrupted.wait(limit_s):
            raise AssertionError(f"nobody interrupted a request to the wedged engine within {limit_s} s")
        self._interrupted.clear()
        raise EngineHung("abandoned: interrupted")

    def _maybe_fail(self, what: str) -> None:
        errors = self.fail.get(what)
        if errors:
            err = errors.pop(0)
            if err is not None:
                raise err

    def engine_limits(self) -> EngineLimits:
        self.calls.append("limits")
        self._maybe_fail("limits")
        return self.limits

    def engine_incarnation(self) -> str:
        self.calls.append("incarnation")
        self._maybe_fail("incarnation")
        return self.incarnation

    def send_base(self, tensors, version: int) -> Ack:
        self.calls.append(f"base v{version}")
        self._maybe_fail("base")
        got = list(tensors)
        n, nbytes = len(got), sum(t.numel() * t.element_size() for _, t in got)
        return self.base_ack(version, n, nbytes) if self.base_ack else Ack(version, n, nbytes)

    def send_adapter(self, payload: AdapterPayload) -> Ack:
        self.calls.append(f"adapter {payload.name}")
        self._maybe_fail("adapter")
        if self.adapter_ack:
            return self.adapter_ack(payload)
        return Ack(payload.version, payload.num_tensors, payload.nbytes, {"transfer_ms": 2.5})

    def retire_adapter(self, name: str, timeout_s: float) -> bool:
        self.unloaded.append((name, timeout_s))
        return self.unload_answer

    def close(self) -> None:
        self.calls.append("close")


class VerifyingEmitter(Emitter):
    """An emitter whose engine loaded a base itself: `record` is what it reports of it."""

    def __init__(self, record: dict | None) -> None:
        super().__init__()
        self.record = record

    def base_digests(self) -> dict:
        self.calls.append("digests")
        self._maybe_fail("digests")
        return self.record

    def adopt_base(self, version: int) -> None:
        self.calls.append(f"adopt v{version}")

    def remember_base_digests(self, ours: dict, version: int) -> None:
        self.remembered = ours

    def send_base_part(self, tensors, version: int) -> Ack:
        got = list(tensors)
        self.calls.append(f"base part v{version}: {[n for n, _ in got]}")
        return Ack(version, len(got), sum(t.numel() * t.element_size() for _, t in got))


class Engine:
    """EmbeddedEngine stand-in: `alive` answers the health checks; ensure_running revives it."""

    log_path = "/runs/engine.log"

    def __init__(self) -> None:
        self.alive = True
        self.events: list[object] = []

    def healthy(self, timeout_s: float) -> bool:
        self.events.append(("healthy", timeout_s))
        return self.alive

    def check(self, timeout_s: float) -> None:
        self.events.append(("check", timeout_s))
        if not self.alive:
            raise EngineDied("the engine exited")

    def ensure_running(self) -> bool:
        self.events.append("restart")
        self.alive = True
        return True

    def kill(self) -> None:
        self.events.append("kill")
        self.alive = False

    def restart(self) -> None:
        self.events.append("restart")
        self.alive = True

    def stop(self) -> None:
        self.events.append("stop")

    def log_tail(self) -> str:
        return "engine: last line"


class Probe:
    """ParityProbe stand-in: reports `worst` as the max |trainer - engine| gap."""

    tolerance = 0.1

    def __init__(self, worst: float = 0.5) -> None:
        self.worst = worst
        self.compared: list[str] = []
        self.fail = False

    def trainer_side(self) -> list[list[float]]:
        return [[-1.0]]

    def compare(self, ours: list[list[float]], adapter: str) -> dict[str, float]:
        assert ours == [[-1.0]]
        self.compared.append(adapter)
        if self.fail:
            raise RuntimeError("score request failed")
        return {"parity_max_abs": self.worst, "parity_mean_abs": self.worst / 2}


@dataclasses.dataclass
class Rig:
    syncer: WeightSyncer
    emitter: Emitter
    source: Source
    base: Base
    engine: Engine | None
    probe: Probe | None
