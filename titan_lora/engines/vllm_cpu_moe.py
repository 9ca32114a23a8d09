"""Two fixes of vLLM 0.32 for a CPU engine on a mixture-of-experts model, installed in the engine process.

- LoRA on: vLLM forces every unquantized MoE layer onto its Triton kernels
  (fused_moe/oracle/unquantized.py:234) and wraps it in a LoRA layer with no CPU path: the engine dies in its
  first forward (`triton.language` has no `bfloat16`). Here the experts keep the CPU kernels and are never
  LoRA layers (expert LoRA is GPU-only in vLLM); attention and dense layers still are.
- A base reload: a weight update skips the CPU experts' prepacking (unquantized_fused_moe_method.py:191-205),
  so the kernel reads the fresh weights as packed ones and serves another model (0.018 max log-prob change
  reloading a tiny model's own checkpoint). Here they are prepacked again, where no padding of the
  intermediate size is involved (it would be applied twice).

The classes come from `vllm_compat.cpu_moe_classes` (the one module that imports vLLM).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from titan_lora.engines.vllm_compat import cpu_moe_classes

logger = logging.getLogger("titan_lora.engine")
_PATCHED = "_titan_lora_cpu_moe"


def install() -> bool:
    """Patch vLLM's MoE config, unquantized MoE method and MoE LoRA layers (idempotent); False if this vLLM
    lacks them."""
    classes = cpu_moe_classes()
    if classes is None:
        return False
    config_cls, method_cls, cpu_experts_cls, lora_layers = classes
    if getattr(config_cls, _PATCHED, False):
        return True
    post_init, setup_kernel = config_cls.__post_init__, method_cls._setup_kernel

    def cpu_experts(self: Any) -> None:
        self.is_lora_enabled = False
        post_init(self)

    def setup_and_prepack(self: Any, layer: Any, w13: torch.Tensor, w2: torch.Tensor) -> None:
        update = self.moe_kernel is not None
        setup_kernel(self, layer, w13, w2)
        experts = self.moe_kernel.fused_experts
        if not update or not isinstance(experts, cpu_experts_cls):
            return
        if experts._padded_intermediate_size(layer.moe_config) != layer.moe_config.intermediate_size_per_partition:
            logger.warning("the CPU experts of %s pad their intermediate size: a base reload serves them unpacked "
                           "(vLLM 0.32)", type(layer).__name__)
            return
        experts.process_weights_after_loading(layer)

    config_cls.__post_init__ = cpu_experts
    method_cls._setup_kernel = setup_and_prepack
    for wrapper in lora_layers:
        wrapper.can_replace_layer = classmethod(lambda cls, *args, **kwargs: False)
    setattr(config_cls, _PATCHED, True)
    return True
