"""Checks that need several sections (or the host), run on the parsed config before any model is built."""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from titan_lora.clients.kinds import EngineKind, engine_kind
from titan_lora.config import Engine, JobConfig, attached_urls
from titan_lora.config_adapters import job_adapters
from titan_lora.lora.targets import EXPERTS, hf_leaf_names
from titan_lora.model_shape import DecoderShape
from titan_lora.models.family import model_family
from titan_lora.titan.parallel import data_parallel_size
from titan_lora.trainer.checkpoint import check_resume_compatible, check_steps_left, named_adapter_signature
from titan_lora.trainer.sft_data import global_batch_size, load_pairs
from titan_lora.transfer.errors import TransferError
from titan_lora.transfer.placement import AUTO, transport_kind
from titan_lora.transfer.transport import SHM_DIR


def check_parallelism(job_config: JobConfig) -> None:
    """Refuse loss parallelism under TP (the objectives need whole-vocabulary logits)."""
    par = job_config.parallelism
    if par.tensor_parallel_degree > 1 and not par.disable_loss_parallel:
        raise ValueError(
            f"[parallelism] tensor_parallel_degree = {par.tensor_parallel_degree} with disable_loss_parallel = "
            "false asks for loss parallelism, which titan_lora does not offer: its objectives (SFT, GRPO "
            "log-probs) read each token's log-prob over the whole vocabulary, so the head's logits are gathered; "
            "remove the key (true is the default)"
        )


def check_tensor_parallel_heads(tp: int, shape: DecoderShape) -> None:
    """Refuse a TP degree that does not divide the model's query and KV heads (torchtitan 0.3.0 shards attention
    by whole heads), before anything is built."""
    if tp > 1 and (shape.n_heads % tp or shape.n_kv_heads % tp):
        raise ValueError(
            f"[parallelism] tensor_parallel_degree = {tp} must divide the model's {shape.n_heads} attention heads "
            f"and {shape.n_kv_heads} KV heads (torchtitan shards attention by whole heads); choose a TP degree "
            f"that divides {math.gcd(shape.n_heads, shape.n_kv_heads)}"
        )


def check_moe(job_config: JobConfig, shape: DecoderShape) -> None:
    """Refuse what a mixture-of-experts model cannot do here yet, naming why, before anything is built."""
    if shape.moe is None:
        return
    if job_config.parallelism.tensor_parallel_degree > 1:
        raise ValueError("[parallelism] tensor_parallel_degree > 1 with a mixture-of-experts model: LoRA on "
                         "TP-sharded experts is not built (nor expert parallelism); shard it with FSDP "
                         "([parallelism] data_parallel_shard_degree)")
    targets = job_config.lora.target_modules
    if job_config.weight_sync.enabled and isinstance(targets, list) and EXPERTS in targets:
        check_expert_sync(job_config.engine)


def check_expert_sync(engine: Engine) -> None:
    """Refuse a sync of adapters on routed experts into an engine that cannot serve them, where that is known
    before the build; an attached vLLM engine says so at start (`EngineLimits.expert_lora`)."""
    fix = ('drop "experts" from [lora] target_modules, or set [weight_sync] enabled = false and export the '
           "adapter (`python -m titan_lora.export.vllm_moe` rewrites it for vLLM)")
    why = None
    if engine.kind == "sglang":
        why = "SGLang loads no adapter on routed experts"
    elif engine.kind == "vllm-disk":
        why = "the disk baseline writes PEFT's fused expert layout, which vLLM 0.32 loads only per expert"
    elif engine.kind == "vllm" and not attached_urls(engine) and not torch.cuda.is_available():
        why = ("the vLLM engine titan_lora starts here runs on CPU, and vLLM 0.32 runs expert LoRA only with its "
               "Triton GPU kernels")
    if why is not None:
        raise ValueError(f"[weight_sync] enabled with adapters on the experts and [engine] kind = {engine.kind!r}: "
                         f"{why}; {fix}")


def linear_dims(shape: DecoderShape) -> dict[str, tuple[int, int]]:
    """The (in, out) features of each linear of a decoder of `shape`, by torchtitan leaf name."""
    q, kv = shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim
    return {"wq": (shape.dim, q), "wk": (shape.dim, kv), "wv": (shape.dim, kv), "wo": (q, shape.dim),
            "w1": (shape.dim, shape.ffn_hidden_dim), "w3": (shape.dim, shape.ffn_hidden_dim),
            "w2": (shape.ffn_hidden_dim, shape.dim), "lm_head": (shape.dim, shape.vocab_size)}


def check_lora_rank(rank: int, targets: list[str], shape: DecoderShape) -> None:
    """Refuse a rank above the smallest dimension of an adapted linear (its update cannot have that rank)."""
    dims = linear_dims(shape)
    sizes = {leaf: min(dims[leaf]) for leaf in sorted({t.rsplit(".", 1)[-1] for t in targets}) if leaf in dims}
    if sizes and rank > min(sizes.values()):
        leaf = min(sizes, key=sizes.get)
        raise ValueError(f"[lora] rank = {rank} is above the model's dimensions: the adapted linear {leaf} is "
                         f"{dims[leaf][0]} -> {dims[leaf][1]}; use a rank of at most {sizes[leaf]}")


def check_host_memory(bucket_mb: int, transport: str) -> None:
    """Refuse buckets that do not fit in this host's memory (the emitter keeps two of them)."""
    total_mb = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2**20
    if 2 * bucket_mb > total_mb:
        raise ValueError(f"[weight_sync] bucket_mb = {bucket_mb}: the emitter double-buffers, which needs "
                         f"{2 * bucket_mb} MiB of host memory for transport {transport!r}, but this host has "
                         f"{total_mb} MiB; lower bucket_mb to at most {total_mb // 2} (the default is 32)")


def check_shared_memory(bucket_mb: int, shm_dir: str = SHM_DIR) -> None:
    """Refuse buckets that do not fit in the free shared memory (the emitter keeps two of them)."""
    if not os.path.isdir(shm_dir):
        return
    st = os.statvfs(shm_dir)
    free_mb = st.f_bavail * st.f_frsize // 2**20
    if 2 * bucket_mb > free_mb:
        raise ValueError(
            f"[weight_sync] bucket_mb = {bucket_mb}: the emitter double-buffers, which needs "
            f"{2 * bucket_mb} MiB of {shm_dir}, but only {free_mb} MiB is free; lower bucket_mb to at most "
            f"{free_mb // 2} "
            "or enlarge /dev/shm (docker: --shm-size)"
        )


def check_grpo_split(prompts_per_step: int, group_size: int, dp_size: int) -> None:
    """Refuse a GRPO batch that the data-parallel ranks cannot share equally."""
    n = prompts_per_step * group_size
    if n % dp_size:
        raise ValueError(
            f"[grpo] prompts_per_step * group_size = {prompts_per_step} * {group_size} = {n} samples do not "
            f"split over {dp_size} data-parallel ranks; make it a multiple of {dp_size}"
        )


def check_transport(engine: Engine, kind: EngineKind) -> str | None:
    """The transport `[engine] transport` selects (None: the device's default); refuses an unknown name,
    or a transport named for a kind that sends no buckets."""
    if engine.transport != AUTO and not kind.shm_buckets:
        raise ValueError(f"[engine] transport = {engine.transport!r}: kind {engine.kind!r} does not send "
                         "buckets, so no transport applies; remove the key (it applies to vllm and receiver)")
    try:  # every replica's: auto may pick shm for one on this host and tcp for one elsewhere
        transport = [transport_kind(engine.transport, url) for url in attached_urls(engine) or [""]][0]
    except ValueError as err:
        raise ValueError(f'[engine] transport = {engine.transport!r}: {err}; or "auto"') from None
    if transport == "cuda_ipc" and not torch.cuda.is_available():
        raise ValueError('[engine] transport = "cuda_ipc" shares GPU memory, but this trainer has no CUDA '
                         'device: use "auto" (shared memory on this host) or "shm"')
    if transport == "nccl" and engine.nccl_backend == "nccl" and not torch.cuda.is_available():
        raise ValueError('[engine] transport = "nccl" sends GPU memory over NCCL, but this trainer has no CUDA '
                         'device: set [engine] nccl_backend = "gloo" to run the same group over gloo on CPU, '
                         'or use transport = "tcp" (an engine on another host) or "auto"')
    return transport


def check_engine(job_config: JobConfig, targets: list[str] | None) -> None:
    """The `[engine]` checks that need its kind's capabilities, the host or other sections."""
    ws, engine = job_config.weight_sync, job_config.engine
    if not ws.enabled:
        return
    kind = engine_kind(engine.kind)
    if kind.launch is None and not attached_urls(engine):
        raise ValueError(f"[engine] kind = {engine.kind!r} attaches to a running server: set "
                         'url = "http://host:port" (titan_lora starts only vllm, vllm-disk and receiver engines)'
                         + (', or urls = [...] for several replicas' if engine.replicas > 1 else ""))
    if job_config.grpo.enabled and job_config.grpo.rollouts and kind.rollouts is None:
        raise ValueError(f"[engine] kind = {engine.kind!r} runs no rollouts for titan_lora: set [grpo] "
                         'rollouts = false, or use a kind that does (vllm, sglang)')
    if kind.launch is not None and kind.check_host is not None and not attached_urls(engine):
        try:  # titan_lora starts this engine here: refuse now rather than after the model is built
            kind.check_host()
        except ValueError as err:
            raise ValueError(f"[engine] kind = {engine.kind!r} starts its engine on this host: {err}"
                             ) from None
    transport = check_transport(engine, kind)
    if kind.shm_buckets and (transport == "shm" or (transport is None and not torch.cuda.is_available())):
        check_shared_memory(ws.bucket_mb)
    if kind.shm_buckets and transport in ("tcp", "nccl"):
        check_host_memory(ws.bucket_mb, transport)
    if kind.max_lora_rank is not None and "lora" in job_config.model.converters:
        kind.max_lora_rank(job_config.lora.rank)  # raises when the engine cannot serve the rank
    if kind.check_targets is not None and targets:
        names = model_family(job_config.model.name).leaf_names
        try:
            kind.check_targets(set(hf_leaf_names(targets, names)))
        except TransferError as err:
            raise ValueError(f"[engine] kind = {engine.kind!r}: {err}") from None


def check_rollback(job_config: JobConfig) -> None:
    """Rolling back needs checkpoints to roll back to."""
    if job_config.training.on_nonfinite == "rollback" and not job_config.checkpoint.enable:
        raise ValueError('[training] on_nonfinite = "rollback" reloads the last checkpoint: set '
                         '[checkpoint] enable = true (or on_nonfinite = "stop")')


def check_sft_data(job_config: JobConfig, dp_size: int) -> None:
    """The SFT job reads `[data] path` after the model is built: a missing or malformed file, or a global batch
    the data or the data-parallel ranks cannot serve, is refused now."""
    if job_config.grpo.enabled:
        return
    try:
        pairs = load_pairs(job_config.data.path)
    except FileNotFoundError as err:
        raise ValueError(f"{err} (a relative path starts at {os.getcwd()}); name a JSONL file with "
                         '{"prompt": ..., "completion": ...} per line') from None
    except ValueError as err:  # a line that is not JSON, or lacks a key: the line is in the message
        hint = "" if "completion" in str(err) else '; each line needs {"prompt": ..., "completion": ...}'
        raise ValueError(f"[data] path = {job_config.data.path!r}: {err}{hint}") from None
    training = job_config.training
    if training.global_batch_size > 0 and training.global_batch_size % dp_size:
        raise ValueError(f"[training] global_batch_size = {training.global_batch_size} does not split over "
                         f"{dp_size} data-parallel ranks: make it a multiple of {dp_size}, or -1 (local_batch_size "
                         "x the data-parallel degree)")
    batch = global_batch_size(training, dp_size)
    if batch > len(pairs):
        raise ValueError(f"a global batch of {batch} sequences ([training] global_batch_size, or local_batch_size "
                         f"x {dp_size} data-parallel ranks) exceeds the {len(pairs)} examples of [data] path = "
                         f"{job_config.data.path!r}: lower it")


def preflight(job_config: JobConfig, targets: list[str] | None, shape: DecoderShape,
              adapter_targets: list[list[str]] | None = None) -> None:
    """Every cross-section check; `targets` are the adapted linears (None: no LoRA; several adapters: any
    adapter's, and `adapter_targets` each adapter's, in table order), `shape` the model's."""
    check_parallelism(job_config)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    dp = data_parallel_size(job_config.parallelism, world_size)  # refuses degrees that do not fit the ranks
    check_tensor_parallel_heads(job_config.parallelism.tensor_parallel_degree, shape)
    check_moe(job_config, shape)
    if targets is not None:
        check_lora_rank(job_config.lora.rank, targets, shape)
    check_sft_data(job_config, dp)
    check_rollback(job_config)
    check_engine(job_config, targets)
    if job_config.grpo.enabled:
        check_grpo_split(job_config.grpo.prompts_per_step, job_config.grpo.group_size, dp)
    if job_config.checkpoint.enable:
        folder = Path(job_config.job.dump_folder) / job_config.checkpoint.folder
        check_steps_left(folder, job_config.training.steps)
        if targets is not None:
            hf_modules = model_family(job_config.model.name).hf_modules
            adapters = None if adapter_targets is None else [
                named_adapter_signature(a.name, a.rank, t, hf_modules)
                for a, t in zip(job_adapters(job_config), adapter_targets)]
            check_resume_compatible(folder, job_config.lora.rank, targets, hf_modules, adapters)
