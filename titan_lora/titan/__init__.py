"""The seam: the one package in titan_lora that imports torchtitan (pinned: 0.2.2).

Every other package takes the torchtitan names it needs from here (an import-linter contract in
`.importlinter` keeps torchtitan out of them, and tests/test_layers.py checks it with grimp), so the next
torchtitan break lands in this package only; 0.3.0, which drops TOML configs, train specs and imperative
TP plans, is the next step (`../shared/research/torchtitan-0.3.md`, issue 34). This package is the bottom
layer: it imports no other titan_lora package, and titan_lora objects come in as arguments.

One concern a module: `configs` (the JobConfig schema that titan_lora parses TOML and overrides into),
`converters` (the model-converter hook into the build), `models` (the `Architecture`: a neutral
`DecoderShape` to torchtitan's model on the meta device, its state-dict adapter), `llama3` and `qwen3` (each
architecture: shape to args, torchtitan's flavors as shapes, HF names and TP plan), `parallel` (ParallelDims,
meshes, activation checkpointing, compile) and `optim` (optimizers, LR schedules, gradient clipping).
"""
