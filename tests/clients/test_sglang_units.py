"""The SGLang emitter's own logic against a scripted client (no HTTP): the server's limits and their
messages, the served and adapted modules, the adapter config, the payload format (bucket metadata, sha256
per tensor, one pickle per TP rank, CUDA reduction by UUID), and the emitter's pass-throughs and builder.
The base session is in test_sglang_units_base.py, the adapter request and retirement in
test_sglang_units_adapter.py, the scripted client in scripted_sglang.py. The conformance tests
(test_sglang*.py) check the same emitter against a server built from SGLang's source; these pin the
branches and messages one by one, with values written out by hand."""

from __future__ import annotations

import base64
import hashlib
import pickle
import types

import pytest
import torch
from scripted_sglang import URL, Client, emitter, info

from titan_lora.clients import sglang
from titan_lora.clients.base import Endpoint
from titan_lora.clients.sglang import pack_bucket, serialize_for_ranks
from titan_lora.clients.sglang_checks import (
    adapter_modules,
    check_adapter,
    check_server,
    served_modules,
    sglang_adapter_config,
)
from titan_lora.config import Engine, WeightSync
from titan_lora.transfer.buckets import plan_buckets
from titan_lora.transfer.errors import TransferError
from titan_lora.transfer.protocol import EngineLimits

# ---- check_server, served_modules, check_adapter, adapter_modules, the config -------------------------


def test_limits_are_the_smaller_slot_count_and_the_served_modules() -> None:
    limits = check_server(info(), URL, keep_versions=2)
    assert limits == EngineLimits(16, 3, frozenset({"q_proj", "k_proj", "v_proj", "qkv_proj"}), expert_lora=False)
    assert check_server(info(max_loaded_loras=None), URL, 2).max_loras == 3
    assert check_server(info(lora_target_modules=frozenset({"all"})), URL, 2).target_modules is None


@pytest.mark.parametrize("overrides, message", [
    ({"enable_lora": False}, "was started without LoRA: restart it with --enable-lora --max-lora-rank R "
                             "--lora-target-modules ..."),
    ({"dp_size": 2}, "runs dp_size=2, and 0.5.23 loads adapters only with one replica: restart it with "
                     "--dp-size 1 (one server per replica)"),
    ({"max_lora_rank": None}, "did not state its LoRA rank and targets (they were inferred from --lora-paths): "
                              "restart it with --max-lora-rank R --lora-target-modules <modules|all>"),
    ({"lora_target_modules": None}, "did not state its LoRA rank and targets (they were inferred from "
                                    "--lora-paths): restart it with --max-lora-rank R --lora-target-modules "
                                    "<modules|all>"),
    ({"max_loaded_loras": 2}, "holds max_loaded_loras=2 adapters, fewer than keep_versions + 1 = 3: restart it "
                              "with --max-loaded-loras 3 (or lower [weight_sync] keep_versions)"),
    ({"max_loras_per_batch": 3}, "holds max_loras_per_batch=3 adapters, fewer than keep_versions + 1 = 3 plus one "
                                 "for base-only requests: restart it with --max-loras-per-batch 4 (or lower "
                                 "[weight_sync] keep_versions)"),
])
def test_a_server_that_cannot_serve_the_window_names_the_flag(overrides: dict, message: str) -> None:
    with pytest.raises(TransferError) as err:
        check_server(info(**overrides), URL, keep_versions=2)
    assert str(err.value) == f"SGLang at {URL} {message}"


def test_exactly_keep_plus_one_slots_are_enough() -> None:
    assert check_server(info(max_loaded_loras=3, max_loras_per_batch=4), URL, 2).max_loras == 3


def test_the_servers_limits_are_checked_naming_its_address() -> None:
    client = Client()
    client.info = info(enable_lora=False)
    with pytest.raises(TransferError, match=f"^SGLang at {URL} was started without LoRA"):
        emitter(client).engine_limits()


def test_served_modules_expand_fused_groups() -> None:
    assert served_modules(None) is None and served_modules(frozenset({"all", "q_proj"})) is None
    assert served_modules(frozenset({"k_proj"})) == {"q_proj", "k_proj", "v_proj", "qkv_proj"}
    assert served_modules(frozenset({"up_proj", "o_proj"})) == {"gate_proj", "up_proj", "gate_up_proj", "o_proj"}
    assert served_modules(frozenset({"o_proj"})) == {"o_proj"}


def test_adapter_modules_are_the_adapted_leaves_and_a_non_peft_name_is_refused() -> None:
    assert adapter_modules(["a.q_proj.lora_A.weight", "a.q_proj.lora_B.weight", "b.embed_tokens.lora_embedding_A",
                            "c.down_proj.lora_B"]) == {"q_proj", "embed_tokens", "down_proj"}
    with pytest.raises(TransferError) as err:
        adapter_modules(["w1", "w2", "w3"])
    assert str(err.value) == ("no LoRA tensor names in the adapter (e.g. ['w1', 'w2']); expected PEFT names such "
                              "as base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")


def test_check_adapter_bounds_and_messages() -> None:
    limits = EngineLimits(8, 3, frozenset({"v_proj", "q_proj"}))
    check_adapter(limits, URL, 8, {"q_proj", "v_proj"})
    check_adapter(EngineLimits(8, 3, None), URL, 8, {"anything"})
    with pytest.raises(TransferError) as err:
        check_adapter(limits, URL, 9, {"q_proj", "v_proj"})
    assert str(err.value) == (f"SGLang at {URL} serves LoRA rank <= 8, the adapter has rank 9: restart it with "
                              "--max-lora-rank 9")
    with pytest.raises(TransferError) as err:
        check_adapter(limits, URL, 8, {"q_proj", "v_proj", "gate_proj", "o_proj"})
    assert str(err.value) == (f"SGLang at {URL} does not adapt ['gate_proj', 'o_proj'] (it serves ['q_proj', "
                              "'v_proj']): restart it with --lora-target-modules gate_proj o_proj q_proj v_proj "
                              "(or all)")


def test_refused_config_keys_are_named_and_values_must_be_json() -> None:
    with pytest.raises(TransferError) as err:
        sglang_adapter_config({"r": 8, "lora_alpha": 16, "target_modules": ["q"], "use_dora": True,
                               "bias": "all"})
    assert str(err.value) == ("the adapter_config sets ['use_dora', \"bias='all'\"], which SGLang 0.5.23 "
                              "ignores or refuses; train the adapter without them")
    with pytest.raises(TypeError) as err:
        sglang_adapter_config({"r": 8, "lora_alpha": 16, "target_modules": ["q"], "x": object})
    assert str(err.value) == f"adapter_config value {object!r} is not JSON-serializable"


# ---- the payload format ----------------------------------------------------------------------------


def test_a_bucket_holds_sglangs_metadata_fields_and_sha256_per_tensor() -> None:
    tensors = {"a": torch.arange(6.0, dtype=torch.float32).view(2, 3), "b": torch.ones(5, dtype=torch.bfloat16)}
    (entries,) = plan_buckets(tensors, 1 << 20)
    bucket = pack_bucket(entries, tensors)
    a, b = bucket.metadata
    assert (a.name, a.shape, a.dtype, a.start_idx, a.end_idx, a.numel) == ("a", torch.Size([2, 3]), torch.float32,
                                                                           0, 24, 24)
    assert (b.name, b.shape, b.dtype, b.start_idx, b.end_idx, b.numel) == ("b", torch.Size([5]), torch.bfloat16,
                                                                           64, 74, 10)
    assert bucket.flat.dtype == torch.uint8 and bucket.flat.numel() == 74
    assert torch.count_nonzero(bucket.flat[24:64]) == 0, "padding is zeros"
    assert bucket.payload() == {"flattened_tensor": bucket.flat, "metadata": bucket.metadata}
    raw_a = tensors["a"].numpy().tobytes()
    raw_b = tensors["b"].view(torch.int16).numpy().tobytes()
    assert bucket.checksums() == {"a": hashlib.sha256(raw_a).hexdigest(), "b": hashlib.sha256(raw_b).hexdigest()}


def test_a_bucket_is_packed_on_its_tensors_device() -> None:
    tensors = {"a": torch.empty(4, device="meta"), "b": torch.empty(2, device="meta")}
    (entries,) = plan_buckets(tensors, 1 << 20)
    assert pack_bucket(entries, tensors).flat.device.type == "meta"


def test_cpu_payloads_are_plain_pickles_one_per_rank() -> None:
    obj = {"flattened_tensor": torch.arange(4, dtype=torch.uint8), "metadata": [types.SimpleNamespace(name="x")]}
    out = serialize_for_ranks(obj, 3, cuda=False)
    assert len(out) == 3 and out[0] == out[1] == out[2]
    back = pickle.loads(base64.b64decode(out[0]))
    assert torch.equal(back["flattened_tensor"], obj["flattened_tensor"]) and back["metadata"][0].name == "x"
    assert out[0].isascii()


def test_colocated_payloads_are_pickled_once_per_rank_through_the_cuda_reducer(monkeypatch: pytest.MonkeyPatch) -> None:
    # On CUDA each rank's payload carries its own IPC handle: the reducer runs once per rank. The CUDA
    # reducer is replaced by one that pickles the values, so the path runs without a GPU.
    reduced: list[torch.Tensor] = []
    monkeypatch.setattr(sglang, "_reduce_cuda_by_uuid", lambda t: reduced.append(t) or (torch.tensor, (t.tolist(),)))
    flat = torch.arange(6, dtype=torch.uint8)
    out = serialize_for_ranks({"flattened_tensor": flat, "metadata": []}, 3, cuda=True)
    assert len(out) == 3 and reduced == [flat, flat, flat]
    for payload in out:
        assert payload.isascii()
        back = pickle.loads(base64.b64decode(payload))
        assert torch.equal(back["flattened_tensor"], flat) and back["metadata"] == []


def test_a_cuda_tensor_is_reduced_with_its_device_named_by_uuid(monkeypatch: pytest.MonkeyPatch) -> None:
    args = tuple(range(15))
    reduced: list[torch.Tensor] = []
    monkeypatch.setattr(sglang.reductions, "reduce_tensor",
                        lambda t: reduced.append(t) or (sglang.reductions.rebuild_cuda_tensor, args))
    tensor = torch.zeros(1)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(uuid=f"GPU-uuid-of-{device}"))
    rebuild, got = sglang._reduce_cuda_by_uuid(tensor)
    assert rebuild is sglang.reductions.rebuild_cuda_tensor and reduced == [tensor]
    assert got == (0, 1, 2, 3, 4, 5, "GPU-uuid-of-6", 7, 8, 9, 10, 11, 12, 13, 14)
    monkeypatch.setattr(sglang.reductions, "reduce_tensor", lambda t: ("rebuild_storage", args))
    assert sglang._reduce_cuda_by_uuid(torch.zeros(1)) == ("rebuild_storage", args)


# ---- the emitter's pass-throughs and its builder -----------------------------------------------------


def test_kv_cache_release_and_resume_and_limits_pass_through() -> None:
    client = Client()
    em = emitter(client)
    em.release_kv_cache()
    em.resume_kv_cache()
    assert em.engine_limits() == check_server(client.info, URL, 2)
    em.close()
    assert client.names() == ["server_info", "flush", "release_kv", "resume_kv", "server_info"]
    assert client.calls[1] == ("flush", 42.0), "it waits, bounded, for the server to be idle"


def test_the_registered_builder_wires_the_config() -> None:
    cfg = WeightSync(enabled=True, timeout_s=9.0, retries=4, keep_versions=3, bucket_mb=5)
    em = sglang.build_sglang_emitter(cfg, Engine(kind="sglang", url=URL, pause_mode="in_place"), Endpoint(URL, "k"))
    assert (em.client.url, em.client.timeout_s) == (URL, 9.0)
    assert (em._keep_versions, em._pause_mode, em._bucket_bytes, em._verify) == (3, "in_place", 5 << 20, True)
