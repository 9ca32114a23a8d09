"""The run's sections that torchtitan 0.2.2 defined (`[job]`, `[model]`, `[training]`, `[optimizer]`,
`[lr_scheduler]`, `[parallelism]`, `[checkpoint]`, `[activation_checkpoint]`, `[compile]`, `[debug]`), owned
by titan_lora: only the keys it honours, with torchtitan 0.2.2's names and defaults, so the shipped TOMLs read
the same. torchtitan 0.3.0 has no TOML and reshapes these sections; the seam (`titan_lora.titan`) turns them
into whatever torchtitan's builders take. `DROPPED_SECTIONS` and `DROPPED_KEYS` name the 0.2.2 sections and
keys that are refused, and why.
"""

from dataclasses import dataclass, field
from typing import Literal

import torch


@dataclass
class Job:
    """`[job]`: which file, and where the run writes."""

    config_file: str | None = None
    """The TOML file the job was read from (`--job.config_file`)."""
    dump_folder: str = "./outputs"
    """The run's folder: TensorBoard events (tb/), checkpoints and the exported adapter go under it."""
    description: str = "default job"
    """A label for the run, logged when it starts."""


@dataclass
class Model:
    """`[model]`: the model family, its shape and weights, and the converters applied while it is built."""

    name: str = "llama3"
    """The model family: smollm2, llama3, qwen3, or `package.module:FAMILY` for a plug-in (docs/models.md)."""
    flavor: str = "debugmodel"
    """The family's named shape, used for a random init (load_pretrained = false)."""
    hf_assets_path: str = ""
    """The HF directory (config.json, tokenizer, safetensors: one file or shards with an index) of a family
    that brings no checkpoint of its own (llama3, qwen3); smollm2 uses its own."""
    converters: list[str] = field(default_factory=list)
    """Converters applied to the model while it is built: ["lora"] for LoRA, [] to train the whole model."""
    load_pretrained: bool = False
    """Load the weights of the family's HF directory (its own, e.g. SmolLM2's, else `hf_assets_path`:
    one safetensors file or shards with an index), its shape read from config.json, `flavor` unused;
    false: random init of `flavor`. The tokenizer always comes from that directory."""


@dataclass
class Training:
    """`[training]`: steps, sequence length, batch, clipping and precision."""

    local_batch_size: int = 8
    """SFT: sequences per data-parallel rank and step (GRPO's batch is [grpo] prompts_per_step x group_size)."""
    global_batch_size: int = -1
    """SFT: sequences per step over all ranks; -1: local_batch_size x the data-parallel degree."""
    seq_len: int = 2048
    """Sequence length: the model's RoPE table and the SFT examples' length."""
    max_norm: float = 1.0
    """The norm gradients are clipped to before each optimizer step."""
    steps: int = 10000
    """Optimizer steps of the run."""
    enable_cpu_offload: bool = False
    """FSDP keeps parameters, gradients and optimizer states on the CPU between uses."""
    mixed_precision_param: Literal["bfloat16", "float32"] = "bfloat16"
    """FSDP's compute dtype: parameters are all-gathered and computed in it, and the frozen base is stored in
    it; the adapters' own dtype is [lora] dtype."""
    mixed_precision_reduce: Literal["float32"] = "float32"
    """The dtype gradients are reduced in across data-parallel ranks."""
    on_nonfinite: str = "stop"
    """A NaN/Inf adapter after an optimizer step: "stop" with an error, or "rollback" to the last
    checkpoint and skip that batch (needs [checkpoint] enable; with several [[adapters]], only the adapter
    that holds it goes back, the others keep their step)."""


@dataclass
class Optimizer:
    """`[optimizer]`: one optimizer over the trainable parameters."""

    name: Literal["Adam", "AdamW"] = "AdamW"
    """The optimizer: Adam or AdamW."""
    lr: float = 8e-4
    """The peak learning rate (the LR schedule scales it)."""
    beta1: float = 0.9
    """The first moment's decay."""
    beta2: float = 0.95
    """The second moment's decay."""
    eps: float = 1e-8
    """Added to the denominator for numerical stability."""
    weight_decay: float = 0.1
    """Decoupled weight decay (AdamW) or L2 penalty (Adam)."""
    implementation: Literal["for-loop", "foreach", "fused"] = "fused"
    """torch's implementation: fused (one kernel: fastest), foreach (batched), for-loop (slowest)."""


@dataclass
class LRScheduler:
    """`[lr_scheduler]`: linear warmup, then an optional stable phase, then decay."""

    warmup_steps: int = 200
    """Steps of linear warmup from near 0 to [optimizer] lr."""
    total_steps: int | None = None
    """The steps the schedule spans; unset: [training] steps."""
    decay_ratio: float | None = None
    """The share of the steps spent decaying, at the end (warmup-stable-decay); unset: decay right after warmup."""
    decay_type: Literal["linear", "sqrt", "cosine"] = "linear"
    """The decay's shape."""
    min_lr_factor: float = 0.0
    """The floor of the decay, as a share of [optimizer] lr."""


@dataclass
class Parallelism:
    """`[parallelism]`: data parallelism (FSDP, HSDP) and tensor parallelism over the launched ranks."""

    data_parallel_replicate_degree: int = 1
    """Replicas of the sharded model (HSDP when data_parallel_shard_degree > 1 too); 1: none."""
    data_parallel_shard_degree: int = -1
    """Ranks each FSDP group shards the model over; -1: the ranks the other degrees leave."""
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """Free the gathered parameters after forward (always), keep them to backward (never), or torch's choice."""
    tensor_parallel_degree: int = 1
    """Ranks each layer's weights are split over (TP); 1: none."""
    disable_loss_parallel: bool = True
    """True: the objectives read whole-vocabulary log-probs, so under TP the head's logits are gathered (false
    with tensor_parallel_degree > 1, loss parallelism, is refused)."""


@dataclass
class Checkpoint:
    """`[checkpoint]`: titan_lora's own DCP checkpoints (adapters, optimizer, scheduler, data and RL state),
    and the resume from the newest one in `folder`."""

    enable: bool = False
    """Save checkpoints, and resume from the newest in `folder` at start."""
    folder: str = "checkpoint"
    """Where checkpoints go; a relative path is under [job] dump_folder."""
    interval: int = 500
    """Save every this many steps (and at the last step)."""
    keep_latest_k: int = 10
    """Keep the newest k checkpoints; 0: keep all."""


@dataclass
class ActivationCheckpoint:
    """`[activation_checkpoint]`: recompute activations in backward instead of keeping them."""

    mode: Literal["selective", "full", "none"] = "selective"
    """none, full (every block), or selective (see selective_ac_option)."""
    selective_ac_option: str = "2"
    """selective: "N" checkpoints every Nth block; "op" saves chosen ops' outputs in every block."""


@dataclass
class Compile:
    """`[compile]`: torch.compile on the model's blocks."""

    enable: bool = False
    """Compile each block of the model (they share code: one compile)."""
    components: list[Literal["model"]] = field(default_factory=lambda: ["model"])
    """What is compiled: ["model"] (the objectives run eagerly)."""
    backend: str = "inductor"
    """torch.compile's backend."""


@dataclass
class Debug:
    """`[debug]`."""

    seed: int | None = None
    """The seed of the model's random init and the adapters' init; unset: 0."""


def validate_activation_checkpoint(cfg: ActivationCheckpoint) -> None:
    """Refuse a `selective_ac_option` that torchtitan would reject only after the model is built."""
    option = cfg.selective_ac_option
    if cfg.mode == "selective" and option != "op" and not (option.isdigit() and int(option) >= 1):
        raise ValueError(f'[activation_checkpoint] selective_ac_option = "{option}": write a positive integer N '
                         '(checkpoint every Nth block) or "op" (save chosen ops\' outputs)')


def validate_compile(cfg: Compile) -> None:
    """Refuse a torch.compile backend this torch does not have (it would fail at the first compiled step)."""
    if cfg.enable and cfg.backend not in torch.compiler.list_backends(exclude_tags=()):
        raise ValueError(f"[compile] backend = {cfg.backend!r} is not a torch.compile backend here; known: "
                         f"{', '.join(torch.compiler.list_backends())} (inductor is torch's default), and debug "
                         "backends such as eager and aot_eager")


_DATA_AND_TENSOR_PARALLEL_ONLY = "titan_lora runs data (FSDP/HSDP) and tensor parallelism only"
_OWN_CHECKPOINTS = ("titan_lora saves its own DCP checkpoints ([checkpoint] enable, folder, interval, "
                    "keep_latest_k) and resumes from the newest in folder")
_OWN_DATA = "the data is [data] path (SFT) or the [grpo] task's"
_OWN_METRICS = "titan_lora logs every metric to TensorBoard under [job] dump_folder/tb"

DROPPED_SECTIONS: dict[str, str] = {
    "metrics": _OWN_METRICS,
    "profiling": "titan_lora does not run torch's profiler; scripts/bench_step.py measures steps",
    "comm": "the process group timeout comes from [weight_sync] (docs/reliability.md)",
    "memory_estimation": "titan_lora does not estimate memory; scripts/bench_step.py measures it",
    "fault_tolerance": "titan_lora does not run torchft",
    "experimental": "titan_lora loads no custom torchtitan modules; plug-ins are named in [model] name, "
                    "[engine] kind and [grpo] task",
    "validation": "held-out evaluation is [grpo] eval_size and eval_every",
    "quantize": "titan_lora's LoRA linears are not quantized",
}
"""torchtitan 0.2.2's sections that titan_lora refuses: why (the fix is to delete the section)."""

DROPPED_KEYS: dict[tuple[str, str], str] = {
    **{("job", k): "titan-lora check CONFIG checks a config, and a run logs its file, description and folder"
       for k in ("print_config", "save_config_file")},
    ("job", "custom_config_module"): "titan_lora's sections are built in",
    ("model", "tokenizer_path"): "torchtitan 0.2.2 deprecated it: write hf_assets_path (the tokenizer's directory)",
    ("model", "print_after_conversion"): "a run logs its trainable parameter count, not the model",
    **{("training", k): _OWN_DATA for k in ("dataset", "dataset_path", "dataloader")},
    ("training", "dtype"): "[training] mixed_precision_param is FSDP's compute dtype and [lora] dtype the adapters'",
    **{("training", k): "titan_lora does not schedule Python's garbage collector" for k in ("gc_freq", "gc_debug")},
    ("optimizer", "early_step_in_backward"): "titan_lora clips gradients, which a step in backward cannot",
    **{("parallelism", k): _DATA_AND_TENSOR_PARALLEL_ONLY for k in (
        "pipeline_parallel_degree", "module_fqns_per_model_part", "pipeline_parallel_first_stage_less_layers",
        "pipeline_parallel_last_stage_less_layers", "pipeline_parallel_layers_per_stage",
        "pipeline_parallel_schedule", "pipeline_parallel_schedule_csv", "pipeline_parallel_microbatch_size",
        "pipeline_parallel_expert_parallel_overlap", "context_parallel_degree", "context_parallel_load_balancer",
        "context_parallel_rotate_method", "expert_parallel_degree", "expert_tensor_parallel_degree",
        "expert_parallel_comm_backend", "enable_async_tensor_parallel")},
    **{("checkpoint", k): _OWN_CHECKPOINTS for k in (
        "enable_ft_dataloader_checkpoints", "initial_load_path", "initial_load_model_only", "initial_load_in_hf",
        "initial_load_in_hf_quantized", "last_save_model_only", "last_save_in_hf", "export_dtype", "async_mode",
        "load_step", "exclude_from_loading", "enable_first_step_checkpoint", "create_seed_checkpoint",
        "load_only")},
    **{("activation_checkpoint", k): "titan_lora applies modes none, full and selective (selective_ac_option)"
       for k in ("per_op_sac_force_recompute_mm_shapes_by_fqns", "early_stop", "memory_budget",
                 "visualize_memory_budget_pareto", "preserve_rng_state", "determinism_check", "debug")},
    **{("debug", k): "titan_lora does not switch torch to deterministic algorithms"
       for k in ("deterministic", "deterministic_warn_only")},
    ("debug", "moe_force_load_balance"): "titan_lora's families are dense",
}
"""torchtitan 0.2.2's keys of the sections above that titan_lora refuses: why (the fix is to delete the line)."""
