"""Engine side of a titan_lora transfer: a vLLM worker extension (`worker_extension_cls`).

Its methods are mixed into vLLM's Worker and reached with `collective_rpc`. Arguments are only
strings, ints and JSON-able headers, so they cross vLLM's msgpack hop in multi-process mode too; the
bytes come through a trainer-owned buffer (shared memory or CUDA IPC) that each worker copies out
before acknowledging.

vLLM 0.32 has no LoRA-from-tensors API. Adapters are built with `LoRAModel.from_lora_tensors` and
kept in an in-memory store that the worker's LoRA manager consults instead of the disk, so an LRU
eviction or a base reload can rebuild them (a disk lookup for an unknown id kills the engine).
"""

from __future__ import annotations

import torch
from vllm.config import set_current_vllm_config
from vllm.lora.lora_model import LoRAModel
from vllm.lora.peft_helper import PEFTHelper
from vllm.lora.request import LoRARequest
from vllm.lora.utils import parse_fine_tuned_lora_name
from vllm.platforms import current_platform

from titan_lora.emitters.buckets import LayoutCache, unpack
from titan_lora.emitters.transport import BufferCache
from titan_lora.engines import vllm_cpu_lora

if current_platform.is_cpu():  # runs in every worker process: the extension is imported there
    vllm_cpu_lora.install()

ADAPTER_SCHEME = "titan-mem://"


class TitanLoRAWorkerExtension:
    """Receive buckets, then install them as a LoRA adapter or as the base weights."""

    def _titan_state(self) -> dict:
        state = self.__dict__.get("_titan")
        if state is None:
            state = {"buffers": BufferCache(), "layouts": LayoutCache(), "staging": {}, "adapters": {}}
            self.__dict__["_titan"] = state
            manager = self.model_runner.lora_manager
            original = manager._load_adapter

            def load_adapter(request: LoRARequest):  # noqa: ANN202
                stored = state["adapters"].get(request.lora_int_id)
                return original(request) if stored is None else self._titan_build(request.lora_int_id, *stored)

            manager._load_adapter = load_adapter  # instance attribute shadows the disk loader
        return state

    def _titan_build(self, lora_int_id: int, peft_config: dict, tensors: dict) -> LoRAModel:
        manager = self.model_runner.lora_manager
        models = manager._adapter_manager
        rank, alpha = peft_config["r"], peft_config["lora_alpha"]
        scale = alpha / rank**0.5 if peft_config.get("use_rslora") else alpha / rank
        # vLLM folds the scale into lora_B *in place*; with the scale folded here (into a new B) and
        # a scale of 1 declared, it leaves the stored tensors untouched and A needs no copy.
        helper = PEFTHelper.from_dict({
            **peft_config, "lora_alpha": rank, "use_rslora": False,
            "vllm_max_position_embeddings": manager.max_position_embeddings,
        })
        helper.validate_legal(manager.lora_config)
        mapper = getattr(models.model, "hf_to_vllm_mapper", None)
        return LoRAModel.from_lora_tensors(
            lora_model_id=lora_int_id,
            tensors={k: v * scale if ".lora_B." in k else v for k, v in tensors.items()},
            peft_helper=helper,
            device="cpu",  # the LRU cache keeps adapters on the host; slots live on the device
            dtype=manager.lora_config.lora_dtype,
            model_vocab_size=manager.vocab_size,
            weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
            skip_prefixes=getattr(models.model, "lora_skip_prefixes", None),
        )

    def titan_receive_bucket(self, transfer_id: str, segment: dict, layout: str, header: list[dict] | None) -> dict:
        """Copy one bucket out of the trainer's buffer; the return value is the ack."""
        state = self._titan_state()
        entries = state["layouts"].resolve(layout, header)
        tensors = unpack(state["buffers"].get(segment), entries)
        state["staging"].setdefault(transfer_id, {}).update(tensors)
        return {"tensors": len(tensors), "bytes": sum(e.nbytes for e in entries)}

    def _titan_take(self, transfer_id: str) -> dict[str, torch.Tensor]:
        staged = self._titan_state()["staging"].pop(transfer_id, None)
        if staged is None:
            raise ValueError(f"transfer {transfer_id!r} has no buckets: send them before the commit")
        return staged

    def titan_commit_adapter(self, transfer_id: str, lora_int_id: int, lora_name: str, peft_config: dict) -> dict:
        """Install the staged tensors as adapter `lora_int_id`; returns what was installed."""
        state = self._titan_state()
        tensors = self._titan_take(transfer_id)
        supported = self.titan_lora_info()["target_modules"]  # cheap: no engine state is read
        for name in tensors:
            module, _ = parse_fine_tuned_lora_name(name)
            if module.rsplit(".", 1)[-1] not in supported:
                raise ValueError(f"adapter tensor {name} targets a module this engine cannot adapt ({supported})")
        state["adapters"][lora_int_id] = (dict(peft_config), tensors)
        manager = self.model_runner.lora_manager
        manager.add_adapter(LoRARequest(lora_name, lora_int_id, ADAPTER_SCHEME + lora_name))
        return {"tensors": len(tensors), "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}

    def titan_commit_base(self, transfer_id: str) -> dict:
        """Load the staged tensors (HF names) as the base weights; adapters are re-installed."""
        state = self._titan_state()
        tensors = self._titan_take(transfer_id)
        with set_current_vllm_config(self.vllm_config):
            # reload_weights re-runs the CPU/GPU weight repacking that a plain load_weights skips.
            self.model_runner.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
        manager = self.model_runner.lora_manager
        for lora_int_id in list(state["adapters"]):  # reload_weights dropped every adapter
            manager.add_adapter(LoRARequest(f"id{lora_int_id}", lora_int_id, ADAPTER_SCHEME))
        return {"tensors": len(tensors), "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}

    def titan_remove_adapter(self, lora_int_id: int) -> bool:
        """Forget adapter `lora_int_id` (the server only asks once no request uses it)."""
        self._titan_state()["adapters"].pop(lora_int_id, None)
        return bool(self.model_runner.lora_manager.remove_adapter(lora_int_id))

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
