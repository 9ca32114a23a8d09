"""Every private vLLM name titan_lora uses, and the check of the vLLM version they were written for.

vLLM (0.32, 0.33 too) has no public API to install a LoRA adapter from in-memory tensors, so the
engine side reaches into vLLM's internals, as every framework that does this must. Those internals
change between releases; this module is the one place that names them, in two tiers and fixes:

- the builder tier, used on every version the engine starts on: vLLM's own adapter builder
  (`LoRAModel.from_lora_tensors` with a `PEFTHelper`), the worker LoRA manager's loader (shadowed by
  our in-memory store) and its inner model manager, `parse_fine_tuned_lora_name`, and the model
  runner's `reload_weights`.
  With these alone every adapter is built, packed and activated by vLLM itself: correct, slower.
- the fast tier, only on the versions in TESTED_SERIES: `vllm_fastpath` (recorded plans, batched
  slot writes into the LRU manager's slots) and `vllm_cpu_lora` (grouped CPU LoRA kernels). They
  depend on layer classes, weight containers, LRU-manager fields and kernel signatures that a release
  may change without notice, so on any other version (run only with the opt-in below) they are off,
  and each worker says so once.
- the fixes of vLLM bugs titan_lora's users meet (`score_prompt_rows_under_their_adapter`, and
  `vllm_cpu_moe` through `cpu_moe_classes`): on any version that has the names they patch, since without
  them the engine fails; each acts only where the inputs are laid out as the fix expects, and leaves
  vLLM's behaviour otherwise.

The version check (TESTED_SERIES, the pins scripts/setup.sh installs, the refusal of any other release
and its opt-in TITAN_LORA_ALLOW_UNTESTED_VLLM=1) is `titan_lora.transfer.vllm_release`; the trainer's
preflight runs it too. What vLLM 0.33.0 changes in these names (the OpenAI tier's moved parsers, the fast
tier's classifier head, slot claim and CPU index -1) is in docs/gpu.md; the others are unchanged there.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from titan_lora.transfer.vllm_release import (
    PINS,
    TESTED_SERIES,
    TORCH_PIN,
    installed_version,
    is_tested,
    refusal,
)

logger = logging.getLogger("titan_lora.engine")

VERSION = installed_version()
FAST_PATH = is_tested(VERSION)
"""Whether the fast tier (fast adapter install, grouped CPU kernels) may run on this vLLM."""


def version_refusal() -> str | None:
    """Why this engine must not start on the installed vLLM (naming the supported releases and the fix),
    or None: a tested release, or an untested one the user allowed."""
    return refusal(VERSION)


def check_version_in_worker() -> None:
    """Refuse an untested vLLM that was not allowed (an engine started by `vllm serve` itself, not by
    `engines.vllm_openai`, which refuses before vLLM starts); on an allowed one say once what it turns
    off. Called by each worker, the process that installs adapters (the API server and the engine core
    import this module too, and stay quiet)."""
    why = version_refusal()
    if why is not None:
        raise RuntimeError(why)
    if not FAST_PATH:
        logger.warning(
            "vLLM %s is not a version titan_lora was tested with (%s): the fast adapter install "
            "(recorded plans, batched slot writes) and the grouped CPU LoRA kernels are disabled; every "
            "adapter goes through vLLM's own builder and activation (same log-probs, slower). Install "
            "one of the tested versions to get them back.", VERSION, " or ".join(s + ".x" for s in TESTED_SERIES))


def _lacks(err: ImportError) -> ImportError:
    """The error for a vLLM that lacks a name titan_lora imports (an untested release), with the fix."""
    return ImportError(f"vLLM {VERSION} lacks a name titan_lora's engine needs ({err}); install the tested "
                       f"release: `pip install {TORCH_PIN} {PINS['gpu']}` (CUDA) or "
                       f"`pip install {PINS['cpu']}` (CPU)")


try:  # the builder tier
    from vllm.config import set_current_vllm_config
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.request import LoRARequest
    from vllm.lora.utils import parse_fine_tuned_lora_name
    from vllm.platforms import current_platform
except ImportError as err:
    raise _lacks(err) from err

if FAST_PATH:  # the fast tier's classes, for vllm_fastpath; a vLLM we did not test may have moved them
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA  # noqa: F401 (re-exported)
    from vllm.lora.layers.classifier import ClassificationHeadWithLoRA  # noqa: F401 (re-exported)
    from vllm.lora.layers.column_parallel_linear import MergedColumnParallelLinearWithLoRA  # noqa: F401 (re-exported)
    from vllm.lora.lora_weights import LoRALayerWeights, PackedLoRALayerWeights  # noqa: F401 (re-exported)


# The builder tier.

def is_cpu() -> bool:
    """True when vLLM runs on its CPU backend."""
    return current_platform.is_cpu()


def worker_member(worker: Any) -> tuple[int, int, str]:
    """The worker's rank, its engine's worker count, and a name its workers share that a restart changes
    (vLLM's own rendezvous address): how it joins the trainer's nccl group."""
    return worker.rank, worker.vllm_config.parallel_config.world_size, worker.distributed_init_method


def lora_manager(worker: Any) -> Any:
    """The worker's LoRA manager (vLLM's WorkerLoRAManager: add_adapter, remove_adapter)."""
    return worker.model_runner.lora_manager


def adapter_manager(manager: Any) -> Any:
    """The LoRA model manager inside the worker's manager (slots, registered adapters, modules)."""
    return manager._adapter_manager


def serve_from_memory(manager: Any, lookup: Callable[[int], LoRAModel | None]) -> None:
    """Make `manager` take adapter ids that `lookup` knows from memory instead of the disk (vLLM
    re-adds adapters by their request after an LRU eviction or a base reload)."""
    original = manager._load_adapter

    def load_adapter(request: LoRARequest) -> LoRAModel:
        model = lookup(request.lora_int_id)
        return original(request) if model is None else model

    manager._load_adapter = load_adapter  # instance attribute shadows the disk loader


def adapted_module(tensor_name: str) -> str:
    """The module a PEFT adapter tensor belongs to, as vLLM parses it."""
    return parse_fine_tuned_lora_name(tensor_name)[0]


def build_adapter(manager: Any, lora_int_id: int, peft_config: dict,
                  tensors: Mapping[str, torch.Tensor]) -> LoRAModel:
    """Adapter `lora_int_id` built by vLLM's own builder, on the host, as its LoRA manager takes it."""
    models = adapter_manager(manager)
    helper = PEFTHelper.from_dict(
        {**peft_config, "vllm_max_position_embeddings": manager.max_position_embeddings})
    helper.validate_legal(manager.lora_config)
    mapper = getattr(models.model, "hf_to_vllm_mapper", None)
    return LoRAModel.from_lora_tensors(
        lora_model_id=lora_int_id,
        tensors=dict(tensors),
        peft_helper=helper,
        device="cpu",  # the LRU cache keeps adapters on the host; slots live on the device
        dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size,
        weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
        skip_prefixes=getattr(models.model, "lora_skip_prefixes", None),
    )


def lora_limits(manager: Any) -> dict:
    """The engine's LoRA limits and the leaf module names it can adapt (packed names expanded)."""
    models = adapter_manager(manager)
    targets = set()
    for module in models.supported_lora_modules:
        targets.update(models.packed_modules_mapping.get(module, [module]))
    return {
        "max_lora_rank": models.lora_config.max_lora_rank,
        "max_loras": models.lora_slots,
        "max_cpu_loras": models.capacity,
        "target_modules": sorted(targets),
        "expert_lora": adapts_experts(manager),
    }


def adapts_experts(manager: Any) -> bool:
    """Whether the engine's routed experts are LoRA layers: vLLM 0.32 wraps them only for its Triton GPU kernels
    (on its CPU backend `vllm_cpu_moe` keeps them plain), and only in a mixture-of-experts model."""
    classes = cpu_moe_classes()
    return classes is not None and any(isinstance(m, classes[3]) for m in adapter_manager(manager).modules.values())


def reload_base(worker: Any, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load `tensors` (HF names) as the base weights; vLLM drops every adapter while doing so."""
    model = worker.model_runner.get_model()
    tied = _tied_weights(model)
    with set_current_vllm_config(worker.vllm_config):
        # reload_weights re-runs the CPU/GPU weight repacking that a plain load_weights skips.
        worker.model_runner.reload_weights(weights_iterator=iter(tensors), is_checkpoint_format=True)
        _retie(tied)


def _tied_weights(model: torch.nn.Module) -> list[tuple[torch.nn.Module, torch.nn.Module, torch.Tensor]]:
    """(owner, alias, weight) for each module whose `weight` is another's (a tied output head)."""
    first: dict[int, torch.nn.Module] = {}
    pairs = []
    for module in model.modules():
        weight = module.__dict__.get("_parameters", {}).get("weight")
        if weight is None:
            continue
        if id(weight) in first:
            pairs.append((first[id(weight)], module, weight))
        else:
            first[id(weight)] = module
    return pairs


def _retie(tied: list[tuple[torch.nn.Module, torch.nn.Module, torch.Tensor]]) -> None:
    """After a reload: point each alias at the weight its owner now holds, and let its quant method repack
    it. vLLM's layer-wise reload materialises the owner's weight anew and puts the alias's old tensors
    back (the alias loads nothing: its checkpoint name is skipped), and its CPU kernel keeps a packed copy
    of the old values: without this a tied head would keep computing with the base before the reload."""
    for owner, alias, old in tied:
        weight = owner.weight if owner.weight is not old else alias.weight
        alias.weight = owner.weight = weight
        method = getattr(alias, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(alias)


def model_dtype(worker: Any) -> torch.dtype:
    """The dtype the engine holds its weights in (checkpoint tensors are cast to it as they load)."""
    return worker.vllm_config.model_config.dtype


def tee_checkpoint_loads(record: Callable[[str, torch.Tensor, torch.dtype], None]) -> None:
    """Show `record` every checkpoint tensor vLLM's default loader reads (at start-up and on a reload from
    disk) with the dtype it is cast to; the weights still load as before. A loader that reads no
    checkpoint (`--load-format dummy`) shows nothing."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    read = DefaultModelLoader.get_all_weights
    if getattr(read, "titan_tee", False):
        return

    def get_all_weights(self: Any, model_config: Any, model: Any) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in read(self, model_config, model):
            record(name, tensor, model_config.dtype)
            yield name, tensor

    get_all_weights.titan_tee = True
    DefaultModelLoader.get_all_weights = get_all_weights


def own_checkpoint(worker: Any) -> Iterator[tuple[str, torch.Tensor]] | None:
    """The tensors of the checkpoint the engine was started from, read again by its own loader; None when
    its loader reads none (`--load-format dummy`)."""
    from vllm.model_executor.model_loader import get_model_loader

    loader = get_model_loader(worker.vllm_config.load_config)
    if not hasattr(loader, "get_all_weights"):
        return None
    return loader.get_all_weights(worker.vllm_config.model_config, worker.model_runner.get_model())


# The fast tier: fields of vLLM 0.32's LRUCacheLoRAModelManager and its CPU LoRA ops.

def registered_adapters(models: Any) -> dict[int, LoRAModel]:
    """The LRU manager's registered adapters by id (written directly to skip its packing pass)."""
    return models._registered_adapters


def active_adapters(models: Any) -> Any:
    """The LRU manager's cache of adapters held in slots (touch, remove_oldest, membership)."""
    return models._active_adapters


def pack_merged(models: Any, model: LoRAModel) -> None:
    """Pack q/k/v and gate/up of `model` in place, as registering it would (folding the scales)."""
    models._create_merged_loras_inplace(model)


def layer_weights(models: Any, model: LoRAModel, module_name: str) -> Any:
    """The LoRA weights of `model` for module `module_name`, or None."""
    return models._get_lora_layer_weights(model, module_name)


def swap_cpu_lora_kernels(kernels: Mapping[str, Callable]) -> dict[str, Callable] | None:
    """Put `kernels` in place of vLLM's CPU LoRA ops of the same names; returns the ones replaced,
    or None when this vLLM has no CPU LoRA ops."""
    try:
        from vllm.lora.ops.torch_ops import lora_ops
        from vllm.lora.punica_wrapper import punica_cpu
    except ImportError:
        return None
    replaced = {}
    for name, fn in kernels.items():
        replaced[name] = getattr(lora_ops, name)
        setattr(lora_ops, name, fn)  # the sgmv_* wrappers look these up as module globals
        setattr(punica_cpu, name, fn)  # punica_cpu imported them by name
    return replaced


# A fix of vLLM 0.32: prompt log-probs under LoRA in a batch of several requests (CPU backend).

_PROMPT_ROWS: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar("titan_prompt_rows",
                                                                                  default=None)
_PATCHED = "_titan_lora_patched"


def score_prompt_rows_under_their_adapter() -> bool:
    """Make vLLM's CPU backend compute a request's prompt log-probs under that request's adapter when other
    requests share its batch (idempotent); False when this vLLM lacks the pieces, and nothing changes.

    vLLM 0.32 computes each prompt-logprobs request's logits from its own prompt rows
    (v1/worker/gpu_model_runner.py:5373-5375, `_get_prompt_logprobs_dict`), and the LoRA logits
    processor adds the adapter's lm_head delta with the punica wrapper's `sampler_indices`
    (lora/layers/logits_processor.py:204, punica_wrapper/punica_cpu.py:349-350): one index per sampled
    token of the whole batch (v1/worker/gpu_input_batch.py:1013), not one per row. Alone, the request's one
    index broadcasts over its rows; in a batch of n requests the CPU ops' einsum
    (lora/ops/torch_ops/lora_ops.py:78) meets n indices for the rows and raises, which ends the engine core.
    While those logits are computed, the sampler indices are the request's own: its rows'
    `token_lora_indices` (one per scheduled token, laid out as the hidden states), as one index when they
    agree, which is what vLLM computes for a request alone. Rows that are not a slice of the batch's hidden
    states (a vLLM that copies them) keep vLLM's behaviour.
    """
    try:
        from vllm.lora.layers.logits_processor import LogitsProcessorWithLoRA
        from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        return False
    prompt_logprobs = getattr(GPUModelRunner, "_get_prompt_logprobs_dict", None)
    get_logits = getattr(LogitsProcessorWithLoRA, "_get_logits", None)
    if prompt_logprobs is None or get_logits is None or not hasattr(PunicaWrapperCPU, "sampler_indices"):
        return False
    if getattr(get_logits, _PATCHED, False):
        return True

    def get_prompt_logprobs_dict(runner: Any, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        token = _PROMPT_ROWS.set(hidden_states)
        try:
            return prompt_logprobs(runner, hidden_states, *args, **kwargs)
        finally:
            _PROMPT_ROWS.reset(token)

    def lora_logits(layer: Any, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        batch_rows = _PROMPT_ROWS.get()
        if batch_rows is None or not isinstance(layer.punica_wrapper, PunicaWrapperCPU):
            return get_logits(layer, hidden_states, *args, **kwargs)
        with _indices_of_rows(layer.punica_wrapper, batch_rows, hidden_states):
            return get_logits(layer, hidden_states, *args, **kwargs)

    setattr(lora_logits, _PATCHED, True)
    GPUModelRunner._get_prompt_logprobs_dict = get_prompt_logprobs_dict
    LogitsProcessorWithLoRA._get_logits = lora_logits
    return True


def cpu_moe_classes() -> tuple[Any, Any, Any, tuple[Any, ...]] | None:
    """What `vllm_cpu_moe` patches: (FusedMoEConfig, UnquantizedFusedMoEMethod, CPUUnquantizedExperts, the
    MoE LoRA layer classes); None when this vLLM lacks them."""
    try:
        from vllm.lora.layers import fused_moe as lora_moe
        from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    except ImportError:
        return None
    return (FusedMoEConfig, UnquantizedFusedMoEMethod, CPUUnquantizedExperts,
            (lora_moe.FusedMoEWithLoRA, lora_moe.FusedMoE3DWithLoRA))


def _row_offset(batch_rows: torch.Tensor, rows: torch.Tensor) -> int | None:
    """Where `rows` starts in `batch_rows` when it is a slice of its rows, else None."""
    if (rows.dim() != 2 or batch_rows.dim() != 2 or rows.stride() != batch_rows.stride()
            or rows.dtype != batch_rows.dtype
            or rows.untyped_storage().data_ptr() != batch_rows.untyped_storage().data_ptr()):
        return None
    row_bytes = batch_rows.stride(0) * batch_rows.element_size()
    start, remainder = divmod(rows.data_ptr() - batch_rows.data_ptr(), row_bytes)
    if remainder or start < 0 or start + rows.shape[0] > batch_rows.shape[0]:
        return None
    return start


@contextlib.contextmanager
def _indices_of_rows(punica: Any, batch_rows: torch.Tensor, rows: torch.Tensor) -> Any:
    """The punica wrapper's sampler indices are those of `rows` (a slice of `batch_rows`) meanwhile."""
    start = _row_offset(batch_rows, rows)
    own = None if start is None else punica.token_lora_indices[start : start + rows.shape[0]]
    if own is None or own.numel() != rows.shape[0] or own.numel() == 0:
        yield
        return
    if bool((own == own[0]).all()):
        own = own[:1]  # one request's rows: its one index broadcasts, as for the request alone
    count = punica.indices_len[1]
    saved = punica.sampler_indices.clone()
    punica._sampler_indices[: own.numel()] = own
    punica.indices_len[1] = own.numel()
    try:
        yield
    finally:
        punica._sampler_indices[:count] = saved
        punica.indices_len[1] = count


# The OpenAI server tier: the pieces of `vllm serve` that titan_lora's OpenAI engine runs as they are.
# They are public modules of vLLM, but not a promised API; they moved between 0.31 and 0.32.

MEMORY_SCHEME = "titan-mem://"
"""The path of every adapter titan_lora installs from memory (the worker never reads it)."""


def fork_engine_cores() -> None:
    """Make vLLM start its engine-core processes by fork (its CPU platform chooses spawn when it checks the
    config, after any environment variable is read: only its engine launcher's context can say fork)."""
    import multiprocessing

    from vllm.v1.engine import utils as engine_utils

    engine_utils.get_mp_context = lambda: multiprocessing.get_context("fork")


def serve_parser(description: str) -> Any:
    """`vllm serve`'s own argument parser: every flag it takes, and the model as a positional."""
    try:  # vLLM 0.33 moved both (docs/gpu.md, "vLLM versions")
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    except ImportError as err:
        raise _lacks(err) from err
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()  # spawn for vLLM's processes, as `vllm serve` sets it before parsing
    return make_arg_parser(FlexibleArgumentParser(description=description))


def serve(args: Any) -> None:
    """Run `vllm serve` with `args` (its API server, AsyncLLM and engine processes) until it stops."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args

    validate_parsed_serve_args(args)
    ServeSubcommand.cmd(args)


async def collective_rpc_all(engine_client: Any, method: str, timeout: float | None, args: tuple) -> list[Any]:
    """`method` on every worker of every engine core the API server manages (all data-parallel ranks),
    each worker's reply in rank order. `AsyncLLM.collective_rpc` reaches them too with the internal load
    balancer, but returns only the first core's replies (vllm/v1/engine/core_client.py,
    `DPLBAsyncMPClient.call_utility_async`); this keeps every core's, so each rank's ack is checked."""
    core = getattr(engine_client, "engine_core", None)
    per_core = getattr(core, "call_utility_all_async", None)
    if per_core is None:  # an in-process core: one engine
        return list(await engine_client.collective_rpc(method, timeout=timeout, args=args))
    replies = await per_core("collective_rpc", method, timeout, args, None)
    return [reply for core_replies in replies for reply in core_replies]


def run_before_shutdown(engine_client: Any, hook: Callable[[], Awaitable[None]], timeout_s: float) -> None:
    """Run `hook` on the API server's event loop when vLLM shuts its engine client down, before it does.

    On SIGTERM vLLM 0.32's `serve_http` (entrypoints/launchers/launcher.py:263-279) stops the engine
    client, and with it the engine core and workers, before uvicorn's lifespan shutdown, so an ASGI
    shutdown hook can no longer reach the workers; and its signal handler lives in uvloop, out of
    reach. It calls `engine_client.shutdown` from an executor thread while the loop stays free, so that
    call is wrapped: `hook` runs first (at most `timeout_s`), once. A shutdown called on the loop's own
    thread (an error path) skips the hook, since waiting there would deadlock.
    """
    loop = asyncio.get_running_loop()
    original = engine_client.shutdown
    ran = False

    def shutdown(*args: Any, **kwargs: Any) -> Any:
        nonlocal ran
        if not ran:
            ran = True
            try:
                asyncio.get_running_loop()
            except RuntimeError:  # not the loop's thread: the loop can run the hook meanwhile
                try:
                    asyncio.run_coroutine_threadsafe(hook(), loop).result(timeout=timeout_s)
                except Exception:  # the shutdown goes on
                    logger.exception("the pre-shutdown hook failed")
        return original(*args, **kwargs)

    engine_client.shutdown = shutdown


def api_keys(args: Any) -> list[str]:
    """The keys vLLM's API server accepts: `--api-key`, else VLLM_API_KEY."""
    import vllm.envs as envs

    return [key for key in (args.api_key or [envs.VLLM_API_KEY]) if key]


def new_lora_id(models: Any) -> int:
    """A LoRA int id from the OpenAI layer's own counter, so runtime loads never collide with ours."""
    return models.lora_id_counter.inc(1)


def serve_adapter(models: Any, name: str, lora_id: int, path: str = "") -> None:
    """Make the OpenAI layer (`OpenAIServingModels`) serve installed adapter `lora_id` as model `name`;
    `path`: a PEFT directory vLLM's own loader reads (empty: one of ours, in memory)."""
    models.lora_requests[name] = LoRARequest(name, lora_id, path or MEMORY_SCHEME + name)


def unserve_adapter(models: Any, name: str) -> None:
    """Stop serving model `name` (requests for it get vLLM's 404)."""
    models.lora_requests.pop(name, None)
