"""Engine kinds: what titan_lora needs to reach one kind of engine and what that kind can do.

One `EngineKind` bundles the emitter, the rollout client, the launcher and the capabilities that
validation asks (never the kind's name). Built-in kinds load lazily (`titan_lora.registry`), so the
registry imports no client; a plug-in kind is registered with `register_engine_kind` or named in the
config as `package.module:KIND`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from titan_lora.clients.base import Emitter, Endpoint
from titan_lora.clients.rollout import RolloutClient
from titan_lora.config import Engine, WeightSync
from titan_lora.registry import Registry
from titan_lora.transfer.protocol import adapter_slots


@dataclasses.dataclass(frozen=True)
class LaunchRequest:
    """What a launcher may read to start an engine for this job."""

    engine: Engine
    keep_versions: int
    hf_dir: str
    device: torch.device
    lora_rank: int
    """The largest rank of the job's adapters."""
    base_digests: bool = True
    """Whether anyone will ask the engine for the digests of the base it loads (`[weight_sync] base =
    "verify"`); False spares it digesting the checkpoint at every start."""
    adapters: int = 1
    """How many adapters the job trains: the engine holds `keep_versions` + 1 versions of each."""

    @property
    def adapter_slots(self) -> int:
        """Live adapter versions the engine must hold (`protocol.adapter_slots`)."""
        return adapter_slots(self.adapters, self.keep_versions)


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """The engine process to start: `python -m module *args`."""

    module: str
    args: list[str]
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    """Set in the engine's environment, over the trainer's own."""
    standby: bool = False
    """Keep a pre-imported interpreter of `module` beside the running engine for its next start
    (`clients.standby`): worth it where importing the module is most of a start (vLLM)."""


EmitterFactory = Callable[[WeightSync, Engine, Endpoint], Emitter]
RolloutFactory = Callable[[Endpoint, WeightSync], RolloutClient]
Launcher = Callable[[LaunchRequest], LaunchPlan]


@dataclasses.dataclass(frozen=True)
class EngineKind:
    """One kind of engine: how to send it weights, sample from it and start it, and what it can do."""

    name: str
    emitter: EmitterFactory
    rollouts: RolloutFactory | None = None
    """None: the kind runs no inference (no rollouts, no eval, no parity probe)."""
    launch: Launcher | None = None
    """None: titan_lora cannot start it; `[engine] url` must name a running one."""
    shm_buckets: bool = False
    """It sends buckets through a bucket transport (`[engine] transport`): on CPU by default POSIX shared
    memory, sized against /dev/shm at start-up."""
    max_lora_rank: Callable[[int], int] | None = None
    """The engine-side rank that holds a LoRA rank; raises when the engine cannot serve it."""
    check_targets: Callable[[set[str]], None] | None = None
    """Raises when the engine cannot serve an adapter on these HF leaf names (e.g. q_proj)."""
    check_host: Callable[[], None] | None = None
    """Raises ValueError when this host cannot run the engine `launch` starts (e.g. an untested vLLM)."""


BUILT_IN_KINDS = {
    "vllm": "titan_lora.clients.vllm_openai:VLLM",
    "vllm-openai": "titan_lora.clients.vllm_openai:VLLM_OPENAI",
    "vllm-disk": "titan_lora.clients.disk:VLLM_DISK",
    "receiver": "titan_lora.clients.vllm:RECEIVER",
    "sglang": "titan_lora.clients.sglang:SGLANG",
}
_KINDS: Registry[EngineKind] = Registry("[engine] kind", "engine kind", BUILT_IN_KINDS, accept=EngineKind)


def register_engine_kind(kind: EngineKind) -> EngineKind:
    """Register a plug-in kind under `kind.name`, for `[engine] kind = name`."""
    return _KINDS.register(kind.name, kind)


def registered_engine_kinds() -> list[str]:
    """The names `[engine] kind` accepts (besides `package.module:KIND`)."""
    return _KINDS.names()


def engine_kind(name: str) -> EngineKind:
    """The kind `[engine] kind` names: a registered name or `package.module:KIND`."""
    return _KINDS.get(name)
