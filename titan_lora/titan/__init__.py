"""The seam: the one package in titan_lora that imports torchtitan (pinned: 0.3.0).

Every other package takes the torchtitan names it needs from here (an import-linter contract in
`.importlinter` keeps torchtitan out of them, and tests/test_layers.py checks it with grimp), so a
torchtitan break lands in this package only (docs/upgrading.md lists what 0.3.0 changed). This package
is the bottom layer: it imports no other titan_lora package but `titan_lora.model_shape`, and titan_lora
objects (the LoRA mixin's `lora_class`, target selection, run sections) come in as arguments.

One concern a module: `configs` (titan_lora's run sections as 0.3.0's optimizer, LR, AC, compile and
parallelism configs), `converters` (the registered model converters, which rewrite a model's config tree
before the build), `decoder` (0.3.0 config trees from a neutral `DecoderShape`, and back), `lora_linear`
(LoRA linears as a config-tree converter), `moe` (Qwen3-MoE's routed experts from a `MoEShape`),
`lora_experts` (LoRA on every expert, the same way), `models` (the `Architecture`: shape to config tree, meta model,
state-dict adapter; lm_head's logits kept whole under TP), `llama3` and `qwen3` (each architecture; qwen3 also its MoE),
`parallel` (ParallelDims on the partial-DTensor backend, meshes, TP, activation checkpointing, compile) and
`optim` (optimizers, LR schedules, gradient clipping).
"""

import torch.distributed.fsdp as _fsdp

if not hasattr(_fsdp, "DataParallelMeshDims"):  # before torchtitan's own import fails on it, less clearly
    import torch as _torch

    raise ImportError(f"torchtitan 0.3.0 needs torch >= 2.12 (torch.distributed.fsdp.DataParallelMeshDims); this is "
                      f"torch {_torch.__version__}: pip install 'torch>=2.12' (scripts/setup.sh installs 2.13.0)")
