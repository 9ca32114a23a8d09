"""Engine side of a titan_lora transfer: a vLLM worker extension (`worker_extension_cls`).

Its methods are mixed into vLLM's Worker and reached with `collective_rpc`. Arguments are only
strings, ints and JSON-able headers, so they cross vLLM's msgpack hop in multi-process mode too; the
bytes come through a trainer-owned buffer (shared memory or CUDA IPC) that each worker copies out
before acknowledging.

vLLM 0.32 has no LoRA-from-tensors API. The first adapter of a run is built with vLLM's own
`LoRAModel.from_lora_tensors`; later ones with the same tensor names reuse what that build resolved
(`vllm_fastpath`). Built adapters stay in an in-memory store that the worker's LoRA manager consults
instead of the disk, so an LRU eviction or a base reload re-adds them (a disk lookup for an unknown id
kills the engine). Adapter bytes land in reusable host slabs: a fresh multi-MB allocation page-faults
on every first touch, which cost more than the copy itself. Staging (bounded per kind), the checksum
check of every bucket and the fault-injection hook live in `titan_lora.engines.transfers`, whose
docstring lists the environment variables (TITAN_LORA_FAULT_BUCKET_PAUSE_S, TITAN_LORA_FAULT_MARKER).
"""

from __future__ import annotations

import dataclasses
import json

import torch
from vllm.config import set_current_vllm_config
from vllm.lora.lora_model import LoRAModel
from vllm.lora.peft_helper import PEFTHelper
from vllm.lora.request import LoRARequest
from vllm.lora.utils import parse_fine_tuned_lora_name
from vllm.platforms import current_platform

from titan_lora.engines import vllm_cpu_lora
from titan_lora.engines.transfers import Staged, TransferStore, fault_pause
from titan_lora.engines.vllm_fastpath import AdapterPlan, install_slot_writer, register
from titan_lora.transfer.buckets import Entry, LayoutCache, bucket_size, copy_out, tensor_views
from titan_lora.transfer.host_copy import copy_flat
from titan_lora.transfer.transport import BufferCache

if current_platform.is_cpu():  # runs in every worker process: the extension is imported there
    vllm_cpu_lora.install()

ADAPTER_SCHEME = "titan-mem://"
SLABS_KEPT_PER_LAYOUT = 2


@dataclasses.dataclass
class _Slab:
    """Host bytes of one adapter bucket, with its tensor views made once."""

    data: torch.Tensor
    views: dict[str, torch.Tensor]


class _SlabPool:
    """Free adapter slabs by bucket layout (a layout fixes size and views)."""

    def __init__(self) -> None:
        self._free: dict[str, list[_Slab]] = {}

    def take(self, layout: str, entries: list[Entry]) -> _Slab:
        free = self._free.get(layout)
        if free:
            return free.pop()
        data = torch.empty(bucket_size(entries), dtype=torch.uint8)
        return _Slab(data, tensor_views(data, entries))

    def give(self, layout: str, slab: _Slab) -> None:
        free = self._free.setdefault(layout, [])
        if len(free) < SLABS_KEPT_PER_LAYOUT:
            free.append(slab)


@dataclasses.dataclass
class _Stored:
    """An installed adapter and the slabs its tensors live in."""

    model: LoRAModel
    slabs: list[tuple[str, _Slab]]


@dataclasses.dataclass
class _State:
    buffers: BufferCache = dataclasses.field(default_factory=BufferCache)
    layouts: LayoutCache = dataclasses.field(default_factory=LayoutCache)
    slabs: _SlabPool = dataclasses.field(default_factory=_SlabPool)
    transfers: TransferStore = dataclasses.field(init=False)
    adapters: dict[int, _Stored] = dataclasses.field(default_factory=dict)
    plans: dict[str, AdapterPlan | None] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.transfers = TransferStore(on_drop=self.give_back)

    def give_back(self, staged: Staged) -> None:
        """Return an uncommitted transfer's adapter slabs to the pool (vLLM never saw them)."""
        for layout, slab in staged.held:
            self.slabs.give(layout, slab)


class TitanLoRAWorkerExtension:
    """Receive buckets, then install them as a LoRA adapter or as the base weights."""

    def _titan_state(self) -> _State:
        state = self.__dict__.get("_titan")
        if state is None:
            state = self.__dict__["_titan"] = _State()
            manager = self.model_runner.lora_manager
            original = manager._load_adapter

            def load_adapter(request: LoRARequest) -> LoRAModel:
                stored = state.adapters.get(request.lora_int_id)
                return original(request) if stored is None else stored.model

            manager._load_adapter = load_adapter  # instance attribute shadows the disk loader
            install_slot_writer(manager._adapter_manager, lambda lora_id: lora_id in state.adapters)
        return state

    def _titan_check_targets(self, tensors: dict[str, torch.Tensor]) -> None:
        supported = self.titan_lora_info()["target_modules"]
        for name in tensors:
            module, _ = parse_fine_tuned_lora_name(name)
            if module.rsplit(".", 1)[-1] not in supported:
                raise ValueError(f"adapter tensor {name} targets a module this engine cannot adapt ({supported})")

    def _titan_build(
        self, lora_int_id: int, peft_config: dict, tensors: dict[str, torch.Tensor]
    ) -> tuple[LoRAModel, bool]:
        """The adapter as vLLM's LoRA manager takes it, and whether a recorded plan built it (vLLM
        builds the first one with these names)."""
        plans = self._titan_state().plans
        key = json.dumps(peft_config, sort_keys=True) + "\n" + "\n".join(tensors)
        plan = plans.get(key)
        if plan is not None:
            return plan.build(lora_int_id, tensors), True
        self._titan_check_targets(tensors)
        manager = self.model_runner.lora_manager
        models = manager._adapter_manager
        helper = PEFTHelper.from_dict(
            {**peft_config, "vllm_max_position_embeddings": manager.max_position_embeddings})
        helper.validate_legal(manager.lora_config)
        mapper = getattr(models.model, "hf_to_vllm_mapper", None)
        model = LoRAModel.from_lora_tensors(
            lora_model_id=lora_int_id,
            tensors=tensors,
            peft_helper=helper,
            device="cpu",  # the LRU cache keeps adapters on the host; slots live on the device
            dtype=manager.lora_config.lora_dtype,
            model_vocab_size=manager.vocab_size,
            weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
            skip_prefixes=getattr(models.model, "lora_skip_prefixes", None),
        )
        plans[key] = AdapterPlan.record(models, model, tensors)
        return model, False

    def titan_receive_bucket(self, transfer_id: str, segment: dict, layout: str, header: list[dict] | None,
                             kind: str = "adapter", checksum: str | None = None) -> dict:
        """Copy one bucket out of the trainer's buffer and check it; the return value is the ack."""
        state = self._titan_state()
        entries = state.layouts.resolve(layout, header)
        buffer = state.buffers.get(segment)  # refuses anything but a bare segment name
        staged = state.transfers.stage(transfer_id, kind, state.buffers.prune)
        fault_pause()
        if kind == "adapter":  # into a reusable host slab (vLLM keeps adapters on the host)
            slab = state.slabs.take(layout, entries)
            copy_flat(slab.data, buffer[: slab.data.numel()])
            return state.transfers.hold(transfer_id, staged, slab.data, slab.views, checksum, (layout, slab))
        owned, views = copy_out(buffer, entries)
        return state.transfers.hold(transfer_id, staged, owned, views, checksum)

    def titan_commit_adapter(self, transfer_id: str, lora_int_id: int, lora_name: str, peft_config: dict) -> dict:
        """Install the staged tensors as adapter `lora_int_id`; returns what was installed."""
        state = self._titan_state()
        staged = state.transfers.take(transfer_id)
        model, planned = self._titan_build(lora_int_id, peft_config, staged.tensors)
        state.adapters[lora_int_id] = _Stored(model, staged.held)
        manager = self.model_runner.lora_manager
        try:
            if planned:
                register(manager._adapter_manager, model)
            else:
                manager.add_adapter(LoRARequest(lora_name, lora_int_id, ADAPTER_SCHEME + lora_name))
        except Exception:
            state.adapters.pop(lora_int_id)
            raise
        return staged.size()

    def titan_commit_base(self, transfer_id: str) -> dict:
        """Load the staged tensors (HF names) as the base weights; adapters are re-installed."""
        state = self._titan_state()
        staged = state.transfers.take(transfer_id)
        with set_current_vllm_config(self.vllm_config):
            # reload_weights re-runs the CPU/GPU weight repacking that a plain load_weights skips.
            self.model_runner.reload_weights(weights_iterator=iter(staged.tensors.items()),
                                             is_checkpoint_format=True)
        manager = self.model_runner.lora_manager
        for lora_int_id in list(state.adapters):  # reload_weights dropped every adapter
            manager.add_adapter(LoRARequest(f"id{lora_int_id}", lora_int_id, ADAPTER_SCHEME))
        return staged.size()

    def titan_remove_adapter(self, lora_int_id: int) -> bool:
        """Forget adapter `lora_int_id` (the server only asks once no request uses it)."""
        state = self._titan_state()
        removed = bool(self.model_runner.lora_manager.remove_adapter(lora_int_id))
        stored = state.adapters.pop(lora_int_id, None)
        for layout, slab in stored.slabs if stored is not None else ():
            state.slabs.give(layout, slab)  # vLLM holds no view of it any more
        return removed

    def titan_lora_info(self) -> dict:
        """The engine's LoRA limits and the leaf module names it can adapt (packed names expanded)."""
        models = self.model_runner.lora_manager._adapter_manager
        targets = set()
        for module in models.supported_lora_modules:
            targets.update(models.packed_modules_mapping.get(module, [module]))
        return {
            "max_lora_rank": models.lora_config.max_lora_rank,
            "max_loras": models.lora_slots,
            "max_cpu_loras": models.capacity,
            "target_modules": sorted(targets),
        }
