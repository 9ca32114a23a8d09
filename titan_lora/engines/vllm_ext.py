"""Engine side of a titan_lora transfer: a vLLM worker extension (`worker_extension_cls`).

Its methods are mixed into vLLM's Worker and reached with `collective_rpc`. Arguments are only
strings, ints and JSON-able headers, so they cross vLLM's msgpack hop in multi-process mode too; the
bytes come through a trainer-owned buffer (shared memory or CUDA IPC, or fetched over tcp or received
over the trainer's nccl group, which every worker joins) that each worker copies out before acknowledging.

vLLM 0.32 has no LoRA-from-tensors API. The first adapter of a run is built with vLLM's own
`LoRAModel.from_lora_tensors`; later ones with the same tensor names reuse what that build resolved
(`vllm_fastpath`), on the vLLM versions that `vllm_compat` (the one module naming vLLM internals) was
tested with; on others (run only with TITAN_LORA_ALLOW_UNTESTED_VLLM=1) every adapter goes through
vLLM's builder and activation. Built adapters stay in an in-memory store that the worker's LoRA
manager consults instead of the disk, so an LRU eviction or a base reload re-adds them (a disk lookup
for an unknown id kills the engine). Adapter bytes land in reusable host slabs: a fresh multi-MB
allocation page-faults on every first touch, which cost more than the copy itself. Staging (bounded per kind), the checksum
check of every bucket and the fault-injection hook live in `titan_lora.engines.transfers`, whose
docstring lists the environment variables (TITAN_LORA_FAULT_BUCKET_PAUSE_S, TITAN_LORA_FAULT_MARKER).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import time

import torch

from titan_lora.engines import base_record, vllm_cpu_moe
from titan_lora.engines import vllm_compat as compat
from titan_lora.engines.transfers import BucketRequest, Slab, SlabPool, Staged, TransferStore, receive
from titan_lora.engines.vllm_compat import LoRAModel, LoRARequest
from titan_lora.transfer.buckets import LayoutCache
from titan_lora.transfer.moe_layout import per_expert_adapter
from titan_lora.transfer.transport import BufferCache
from titan_lora.transfer.transports.base import transport_named

compat.check_version_in_worker()  # runs in every worker process: the extension is imported there
if base_record.RECORDING:  # imported before the worker loads its model
    compat.tee_checkpoint_loads(base_record.record)
if compat.FAST_PATH:  # both drive vLLM internals that only the tested versions are known to have
    from titan_lora.engines import vllm_cpu_lora, vllm_fastpath

    # Runs in every worker process: the extension is imported there.
    CPU_KERNELS = compat.is_cpu() and vllm_cpu_lora.install()
else:
    CPU_KERNELS = False
# Without it a CPU engine core dies when a prompt-logprobs request shares a batch (on any vLLM that has
# the names it patches).
PROMPT_LOGPROBS_FIX = compat.is_cpu() and compat.score_prompt_rows_under_their_adapter()
# Without it a CPU engine on a mixture-of-experts model dies with LoRA on, and serves garbage after a base reload.
MOE_ON_CPU_FIX = compat.is_cpu() and vllm_cpu_moe.install()

logger = logging.getLogger(__name__)
ADAPTER_SCHEME = compat.MEMORY_SCHEME
SLABS_KEPT_PER_LAYOUT = 2
HOST = torch.device("cpu")


@dataclasses.dataclass
class _Stored:
    """An installed adapter and the slabs its tensors live in."""

    model: LoRAModel
    slabs: list[tuple[str, Slab]]


@dataclasses.dataclass
class _State:
    buffers: BufferCache = dataclasses.field(default_factory=BufferCache)
    layouts: LayoutCache = dataclasses.field(default_factory=LayoutCache)
    # Adapters on the host (vLLM keeps them there); the base in slabs on the buffer's device, never reused.
    slabs: SlabPool = dataclasses.field(default_factory=lambda: SlabPool(HOST, SLABS_KEPT_PER_LAYOUT))
    base_slabs: SlabPool = dataclasses.field(default_factory=lambda: SlabPool(None, 0))
    transfers: TransferStore = dataclasses.field(init=False)
    adapters: dict[int, _Stored] = dataclasses.field(default_factory=dict)
    # Recorded by the fast path only.
    plans: dict[str, vllm_fastpath.AdapterPlan | None] = dataclasses.field(default_factory=dict)
    expert_lora: bool | None = None  # whether vLLM made the routed experts LoRA layers; read at the first need

    def __post_init__(self) -> None:
        self.transfers = TransferStore(on_drop=self.give_back)

    def model(self, lora_int_id: int) -> LoRAModel | None:
        """The installed adapter `lora_int_id`, or None when it is not ours."""
        stored = self.adapters.get(lora_int_id)
        return None if stored is None else stored.model

    def pool(self, kind: str) -> SlabPool:
        """Where the buckets of a `kind` transfer are copied to."""
        return self.base_slabs if kind == "base" else self.slabs

    def give_back(self, staged: Staged) -> None:
        """Return an uncommitted transfer's slabs to their pool (vLLM never saw them)."""
        self.pool(staged.kind).give_all(staged)


class TitanLoRAWorkerExtension:
    """Receive buckets, then install them as a LoRA adapter or as the base weights."""

    def _titan_state(self) -> _State:
        state = self.__dict__.get("_titan")
        if state is None:
            state = self.__dict__["_titan"] = _State()
            # Every worker of this engine joins one nccl group with the trainer (if nccl is used).
            transport_named("nccl").opener.join_as(*compat.worker_member(self))
            manager = compat.lora_manager(self)
            compat.serve_from_memory(manager, state.model)
            if compat.FAST_PATH:
                vllm_fastpath.install_slot_writer(compat.adapter_manager(manager),
                                                  lambda lora_id: lora_id in state.adapters)
        return state

    def _titan_check_targets(self, tensors: dict[str, torch.Tensor]) -> None:
        supported = self.titan_lora_info()["target_modules"]
        for name in tensors:
            module = compat.adapted_module(name)
            if module.rsplit(".", 1)[-1] not in supported:
                raise ValueError(f"adapter tensor {name} targets a module this engine cannot adapt ({supported})")

    def _titan_build(
        self, lora_int_id: int, peft_config: dict, tensors: dict[str, torch.Tensor]
    ) -> tuple[LoRAModel, bool]:
        """The adapter as vLLM's LoRA manager takes it, and whether a recorded plan built it (vLLM
        builds the first one with these names, and every one off the fast path). Expert adapters arrive as PEFT
        fuses them and are built per expert (`transfer/moe_layout.py`)."""
        state = self._titan_state()
        if peft_config.get("target_parameters"):  # routed experts, fused as PEFT has them: vLLM takes them per expert
            if state.expert_lora is None:
                state.expert_lora = compat.adapts_experts(compat.lora_manager(self))
            if not state.expert_lora:
                raise ValueError("this engine's routed experts are not LoRA layers (vLLM 0.32 runs expert LoRA only "
                                 "with its Triton GPU kernels): send adapters without \"experts\" in their targets")
            tensors, peft_config = per_expert_adapter(tensors, peft_config)
        plans = state.plans
        key = json.dumps(peft_config, sort_keys=True) + "\n" + "\n".join(tensors)
        plan = plans.get(key)
        if plan is not None:
            return plan.build(lora_int_id, tensors), True
        self._titan_check_targets(tensors)
        manager = compat.lora_manager(self)
        model = compat.build_adapter(manager, lora_int_id, peft_config, tensors)
        if compat.FAST_PATH:
            plans[key] = vllm_fastpath.AdapterPlan.record(compat.adapter_manager(manager), model, tensors)
        return model, False

    def titan_receive_bucket(self, transfer_id: str, segment: dict, layout: str, header: list[dict] | None,
                             kind: str = "adapter", checksum: str | None = None) -> dict:
        """Copy one bucket out of the trainer's buffer and check it; the return value is the ack."""
        state = self._titan_state()
        bucket = BucketRequest.parse({"transfer_id": transfer_id, "kind": kind, "segment": segment,
                                      "layout": layout, "checksum": checksum})
        entries = state.layouts.resolve(layout, header)
        return receive(state.buffers, state.pool(kind), state.transfers, bucket, entries)

    def titan_commit_adapter(self, transfer_id: str, lora_int_id: int, lora_name: str, peft_config: dict) -> dict:
        """Install the staged tensors as adapter `lora_int_id`; returns what was installed."""
        staged = self._titan_state().transfers.take(transfer_id)
        self._titan_install(staged, lora_int_id, lora_name, peft_config)
        return staged.size()

    def titan_commit_adapters(self, transfer_id: str, adapters: list[list]) -> list[dict]:
        """Install a transfer of several adapters (`protocol.adapter_set_name`), each `[lora_int_id, lora_name,
        peft_config]` in the transfer's order; all or none: a failed install removes the ones before it."""
        specs = [(int(lora_int_id), str(lora_name), dict(peft_config)) for lora_int_id, lora_name, peft_config
                 in adapters]  # a malformed one fails here, before any slab is taken
        state = self._titan_state()
        parts = state.transfers.take_set(transfer_id, len(specs))
        done: list[int] = []
        try:
            for (lora_int_id, lora_name, peft_config), staged in zip(specs, parts, strict=True):
                self._titan_install(staged, lora_int_id, lora_name, peft_config)
                done.append(lora_int_id)
        except Exception:
            for lora_int_id in done:  # each on its own: one failed removal must not keep the others
                try:
                    self.titan_remove_adapter(lora_int_id)
                except Exception:  # the install's error is the one to raise
                    logger.exception("removing adapter %d after a failed install of its set", lora_int_id)
            for staged in parts[len(done) + 1:]:  # never installed: their shares of the slabs go back
                state.slabs.give_all(staged)
            raise
        return [staged.size() for staged in parts]

    def _titan_install(self, staged: Staged, lora_int_id: int, lora_name: str, peft_config: dict) -> None:
        """Build `staged` into adapter `lora_int_id` and register it with vLLM's LoRA manager. A failed build
        gives its slabs back (vLLM never saw them); a failed registration keeps them out of the pool, since the
        manager may already hold views of them."""
        state = self._titan_state()
        try:
            model, planned = self._titan_build(lora_int_id, peft_config, staged.tensors)
        except Exception:
            state.slabs.give_all(staged)
            raise
        state.adapters[lora_int_id] = _Stored(model, staged.held)
        manager = compat.lora_manager(self)
        try:
            if planned:
                vllm_fastpath.register(compat.adapter_manager(manager), model)
            else:
                manager.add_adapter(LoRARequest(lora_name, lora_int_id, ADAPTER_SCHEME + lora_name))
        except Exception:
            state.adapters.pop(lora_int_id)
            raise

    def titan_receive_and_commit(self, transfer_id: str, segment: dict, layout: str, header: list[dict] | None,
                                 checksum: str | None, lora_int_id: int, lora_name: str, peft_config: dict) -> dict:
        """An adapter's last bucket and its commit in one call (one engine round trip fewer); the
        commit's ack carries the install time in this worker."""
        ack = self.titan_receive_bucket(transfer_id, segment, layout, header, "adapter", checksum)
        started = time.perf_counter()
        commit = self.titan_commit_adapter(transfer_id, lora_int_id, lora_name, peft_config)
        return {**ack, "commit": {**commit, "apply_ms": (time.perf_counter() - started) * 1e3}}

    def titan_receive_and_commit_set(self, transfer_id: str, segment: dict, layout: str, header: list[dict] | None,
                                     checksum: str | None, adapters: list[list]) -> dict:
        """The last bucket of a transfer of several adapters and their commit (`titan_commit_adapters`) in one
        call; the commit's ack lists each adapter's size."""
        ack = self.titan_receive_bucket(transfer_id, segment, layout, header, "adapter", checksum)
        started = time.perf_counter()
        parts = self.titan_commit_adapters(transfer_id, adapters)
        return {**ack, "commit": {"adapters": parts, "apply_ms": (time.perf_counter() - started) * 1e3}}

    def titan_commit_base(self, transfer_id: str, complete_from_disk: bool = False) -> dict:
        """Load the staged tensors (HF names) as the base weights, with `complete_from_disk` the rest from
        the engine's own checkpoint (the trainer sent only the tensors whose digests differed); adapters
        are re-installed."""
        state = self._titan_state()
        staged = state.transfers.take(transfer_id)
        weights = staged.tensors.items()
        if complete_from_disk:
            own = compat.own_checkpoint(self)
            if own is None:
                raise ValueError("this engine loaded no checkpoint of its own (--load-format dummy): it needs "
                                 "the whole base, not the tensors whose digests differ")
            weights = itertools.chain(weights, ((n, t) for n, t in own if n not in staged.tensors))
        compat.reload_base(self, weights)
        for name, tensor in staged.tensors.items():  # after the reload, whose disk reads the tee records
            base_record.record(name, tensor, compat.model_dtype(self))
        manager = compat.lora_manager(self)
        for lora_int_id in list(state.adapters):  # reload_weights dropped every adapter
            manager.add_adapter(LoRARequest(f"id{lora_int_id}", lora_int_id, ADAPTER_SCHEME))
        return staged.size()

    def titan_remove_adapter(self, lora_int_id: int) -> bool:
        """Forget adapter `lora_int_id` (the server only asks once no request uses it)."""
        state = self._titan_state()
        removed = bool(compat.lora_manager(self).remove_adapter(lora_int_id))
        stored = state.adapters.pop(lora_int_id, None)
        for layout, slab in stored.slabs if stored is not None else ():
            state.slabs.give(layout, slab)  # vLLM holds no view of it any more
        return removed

    def titan_base_digests(self) -> dict:
        """The digest of every base tensor this worker loaded, and their dtype (`base_record`)."""
        return base_record.recorded()

    def titan_ping(self) -> bool:
        """A no-op that reaches this worker through its engine core: LIVE's proof that neither is wedged."""
        return True

    def titan_lora_info(self) -> dict:
        """The engine's LoRA limits, the leaf module names it can adapt (packed names expanded), and
        the vLLM version with the fast parts it runs."""
        return {**compat.lora_limits(compat.lora_manager(self)),
                "vllm": {"version": compat.VERSION, "fast_path": compat.FAST_PATH, "cpu_kernels": CPU_KERNELS}}

    def titan_release_buffers(self) -> int:
        """Unmap every trainer buffer (at shutdown: a CUDA mapping pins the trainer's IPC ref-counter
        file); returns how many were mapped."""
        state = self.__dict__.get("_titan")
        if state is None:  # no bucket came
            return 0
        held = len(state.buffers)
        state.buffers.clear()
        return held
