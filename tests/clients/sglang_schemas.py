"""SGLang 0.5.23's structs as the conformance server (sglang_conformance.py) checks them, written from
SGLang's source: the request schemas of io_struct.py and their validation (unknown top-level fields
ignored, as SGLang does; `/generate`'s types are checked in sglang_generate.py), the routes that take the admin
key, the SafeUnpickler allow-list that payloads are decoded under (with shared-memory handles refused for
a remote engine) and the `serialized_named_tensors` decoding of tp_worker, and the server flags the
conformance server honours (ServerArgs). RefusedError is how a refused request is answered.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import pickle
from collections.abc import Callable
from typing import Any

import torch
from torch.multiprocessing import reductions


class RefusedError(Exception):
    """Answer the request with the error `body` and HTTP `status`."""

    def __init__(self, body: Any, status: int = 400) -> None:
        super().__init__(str(body))
        self.body, self.status = body, status


# ---- request schemas (io_struct.py 0.5.23; every BaseReq also has rid and http_worker_ipc) -----------

Check = Callable[[Any], bool]
_int: Check = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731


def _b64(v: Any) -> bool:
    try:
        return isinstance(v, str) and base64.b64decode(v, validate=True) is not None
    except binascii.Error:
        return False


# Type checks, named like the types they check.
OPT = lambda t: lambda v: v is None or t(v)  # noqa: E731
LIST = lambda t: lambda v: isinstance(v, list) and all(t(x) for x in v)  # noqa: E731
DICT = lambda t: lambda v: isinstance(v, dict) and all(isinstance(k, str) and t(x) for k, x in v.items())  # noqa: E731
LIT = lambda *ok: lambda v: v in ok  # noqa: E731
ANY: Check = lambda v: True  # noqa: E731
STR: Check = lambda v: isinstance(v, str)  # noqa: E731
BOOL: Check = lambda v: isinstance(v, bool)  # noqa: E731
SELECTOR, TAGS = LIT("target", "draft", "all"), OPT(LIST(LIT("kv_cache", "weights", "cuda_graph")))
BASE_REQ = {"rid": OPT(STR), "http_worker_ipc": OPT(STR)}
# http_server.py routes marked ADMIN_OPTIONAL (utils/auth.py); the rest are NORMAL.
ADMIN_OPTIONAL = {"/begin_weight_update", "/end_weight_update", "/update_weights_from_tensor",
                  "/get_weights_by_name", "/load_lora_adapter_from_tensors", "/unload_lora_adapter",
                  "/pause_generation", "/continue_generation", "/flush_cache", "/release_memory_occupation",
                  "/resume_memory_occupation"}
SCHEMAS: dict[str, tuple[dict[str, Check], dict[str, Check]]] = {  # path: (required, optional)
    "/begin_weight_update": ({}, {"selector": SELECTOR}),
    "/end_weight_update": ({}, {}),
    "/get_weights_by_name": ({"name": STR}, {"truncate_size": _int}),
    "/update_weights_from_tensor": ({"serialized_named_tensors": LIST(_b64)}, {
        "load_format": OPT(STR), "flush_cache": BOOL, "abort_all_requests": BOOL,
        "weight_version": OPT(STR), "selector": SELECTOR, "torch_empty_cache": BOOL}),
    "/load_lora_adapter_from_tensors": (
        {"lora_name": STR, "config_dict": DICT(ANY), "serialized_named_tensors": LIST(_b64)},
        {"pinned": BOOL, "added_tokens_config": OPT(DICT(_int)), "lora_id": OPT(STR),
         "load_format": OPT(STR), "expected_checksums": OPT(DICT(STR))}),
    "/unload_lora_adapter": ({"lora_name": STR}, {"lora_id": OPT(STR)}),
    "/pause_generation": ({}, {"mode": LIT("abort", "retract", "in_place")}),
    "/continue_generation": ({}, {"torch_empty_cache": BOOL}),
    "/release_memory_occupation": ({}, {"tags": TAGS}),
    "/resume_memory_occupation": ({}, {"tags": TAGS}),
    # io_struct.py GenerateReqInput; its types are checked by api/v1's contract (sglang_generate.py).
    "/generate": ({}, dict.fromkeys((
        "rid session_id text input_ids input_embeds image_data video_data audio_data mm_hashes "
        "mm_content_hashes use_audio_in_video video_config sampling_params watermark return_logprob "
        "logprob_start_len top_logprobs_num token_ids_logprob return_sampling_mask sampling_logprobs_mode "
        "return_text_in_logprobs return_flat_raw_top_logprobs return_flat_raw_output_top_logprobs "
        "return_flat_raw_top_logprobs_b64 stream log_metrics return_hidden_states return_routed_experts "
        "routed_experts_start_len return_indexer_topk modalities session_params lora_path lora_id "
        "custom_logit_processor positional_embed_overrides bootstrap_host bootstrap_port bootstrap_room "
        "bootstrap_pair_key decode_tp_size routed_dp_rank data_parallel_rank disagg_prefill_dp_rank routing_key "
        "conversation_id http_worker_ipc background require_reasoning max_thinking_tokens priority extra_key "
        "no_logs custom_labels return_bytes return_entropy return_prompt_token_ids external_trace_header "
        "received_time need_wait_for_mm_inputs num_items_assigned encoder_urls max_dynamic_patch "
        "min_dynamic_patch image_max_dynamic_patch video_max_dynamic_patch images_config mm_processor_kwargs "
        "multi_item_delimiter_indices token_indices_to_pool cache_salt kv_hints").split(), ANY)),
}


def validate(path: str, body: Any, ignored: list[str] | None = None) -> None:
    """Refuse a body that does not match the 0.5.23 struct of `path` (400, SGLang's validation shape);
    unknown top-level fields are ignored, as SGLang does, and appended to `ignored`."""
    problems = [] if isinstance(body, dict) else ["the body is not a JSON object"]
    body = body if isinstance(body, dict) else {}
    required, optional = SCHEMAS[path]
    fields = {**BASE_REQ, **required, **optional}
    problems += [f"missing field `{k}`" for k in required if k not in body]
    for key, value in body.items():
        if key not in fields:
            if ignored is not None:
                ignored.append(f"{path}:{key}")
        elif not fields[key](value):
            problems.append(f"field `{key}` has the wrong type: {type(value).__name__}")
    if problems:
        raise RefusedError({"object": "error", "message": "; ".join(problems), "type": "Bad Request",
                            "code": 400})


# ---- payload decoding (the SafeUnpickler policy of sglang/srt/utils/common.py) ---------------------

_REDUCTIONS = "torch.multiprocessing.reductions"
_ALLOWED = {("builtins", n) for n in "dict list tuple set frozenset int float bool str bytes".split()} | {
    ("collections", "OrderedDict"), ("copyreg", "__newobj__"), ("types", "SimpleNamespace"),
    ("torch", "Size"), ("torch", "Tensor"), ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"), ("torch.nn.parameter", "Parameter"),
    ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"),
    (_REDUCTIONS, "rebuild_tensor"), (_REDUCTIONS, "rebuild_typed_storage")}
_SHARED_MEMORY = {(_REDUCTIONS, "rebuild_storage_fd"), (_REDUCTIONS, "rebuild_storage_filename"),
                  ("multiprocessing.resource_sharer", "DupFd")}


def _rebuild_cuda_by_uuid(*args: Any) -> torch.Tensor:
    """SGLang's patched rebuild_cuda_tensor: the sender may name its GPU by UUID (argument 6)."""
    uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
    dev = uuids.index(args[6]) if isinstance(args[6], str) else args[6]
    return reductions.rebuild_cuda_tensor(*args[:6], dev, *args[7:])


class SafeUnpickler(pickle.Unpickler):
    """Unpickles only the globals SGLang allows; `remote` refuses handles another host cannot open."""

    def __init__(self, data: bytes, remote: bool) -> None:
        super().__init__(io.BytesIO(data))
        self.remote = remote

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return lambda b: torch.load(io.BytesIO(b), weights_only=True)
        if (module, name) == (_REDUCTIONS, "rebuild_cuda_tensor"):
            return _rebuild_cuda_by_uuid
        if (module, name) in _SHARED_MEMORY and self.remote:
            raise pickle.UnpicklingError(f"payload holds a shared-memory handle ({module}.{name}) that an "
                                         "engine on another host cannot open; send the tensor bytes")
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in _ALLOWED | _SHARED_MEMORY or dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")


def decode_tensors(payloads: list[str], tp_size: int, load_format: str | None,
                   remote: bool) -> dict[str, torch.Tensor]:
    """Rank 0's named tensors out of `serialized_named_tensors`, read as tp_worker reads them."""
    if len(payloads) != tp_size:
        raise ValueError(f"serialized_named_tensors has {len(payloads)} entries for tp_size={tp_size}")
    data = SafeUnpickler(base64.b64decode(payloads[0], validate=True), remote).load()
    if load_format == "flattened_bucket":
        flat = data["flattened_tensor"]
        named = {m.name: flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape) for m in data["metadata"]}
    elif load_format is None:
        named = dict(data)
    else:
        raise ValueError(f"Unknown load_format={load_format}")
    return {k: v.cpu() for k, v in named.items()}


# ---- the server flags (server_args.py) -----------------------------------------------------------

@dataclasses.dataclass
class ServerArgs:
    """The SGLang server flags the conformance server honours, and two test knobs."""

    enable_lora: bool = True
    max_lora_rank: int | None = 16
    lora_target_modules: list[str] | None = dataclasses.field(default_factory=lambda: ["all"])
    max_loaded_loras: int | None = None
    max_loras_per_batch: int = 8
    tp_size: int = 1
    dp_size: int = 1
    api_key: str | None = None
    admin_api_key: str | None = None
    enable_dp_attention: bool = False
    enable_memory_saver: bool = False
    weight_version: str = "default"
    remote: bool = True  # refuse shared-memory handles, as an engine on another host would fail
    gen_delays_s: tuple[float, ...] = (0.0,)  # how long each /generate holds its adapter, cycled
    enable_deterministic_inference: bool = False  # honours sampling_seed (sampling_batch_info.py)
    detokenize: Any = None  # ids -> the text /generate answers (SGLang's tokenizer); None: ""
    reload_stall_s: float = 30.0  # the implicit reload of a retired name: a hub download that stalls
    partial_load_failures: int = 0  # the next N adapter loads fail on TP rank 1 only (tp_size > 1)
