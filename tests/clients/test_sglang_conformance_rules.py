"""The nine ways a real SGLang 0.5.23 differs from a lenient stand-in, one test or more each.

The conformance server now dies where SGLang dies (an exception in a control request), skips what SGLang
skips, stalls where SGLang stalls; each test checks that titan_lora never sends what would do that.
The SGLang file:line each rule comes from is in docs/sglang.md.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import math
import pickle
import urllib.error
import urllib.request
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
from scripted_sglang import Answering, serving
from sglang_conformance import SCHEMAS, ConformanceServer
from test_sglang import (
    GREEDY,
    LOAD,
    PROMPT,
    SERVER,
    TINY,
    UPDATE,
    Driver,
    Trainer,
    assert_parity,
    calls,
    emitter_at_v1,
    emitter_for,
    policy_versions,
)

from titan_lora.clients import sglang, sglang_api, sglang_checks
from titan_lora.clients.sglang_api import SGLangClient, SGLangError
from titan_lora.transfer.errors import TransferError


def _post(srv: ConformanceServer, path: str, body: dict, key: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(srv.url + path, data=json.dumps(body).encode(), headers=headers,
                                 method="POST" if body is not None else "GET")
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=5) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


# ---------------------------------------------------------------- 2: a control request that raises ends SGLang


def test_the_conformance_server_dies_on_an_undecodable_payload() -> None:
    with ConformanceServer(TINY, **SERVER) as srv:
        client = SGLangClient(srv.url, retries=0)
        assert client.begin_weight_update().success
        buf = io.BytesIO()  # a shared-memory handle, which a remote engine cannot open
        ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump({"w": torch.ones(2)})
        body = sglang_api.UpdateWeightsFromTensorReqInput([base64.b64encode(buf.getvalue()).decode()])
        with pytest.raises(SGLangError, match="broke during /update_weights_from_tensor"):
            client.update_weights_from_tensor(body)
        assert "shared-memory handle" in srv.dead
        with pytest.raises(SGLangError, match="cannot reach SGLang"):
            client.server_info()  # the port is closed: the process is gone


def test_a_base_tensor_of_the_wrong_shape_is_refused_before_sending() -> None:
    trainer = Trainer()
    name = "model.layers.1.mlp.down_proj.weight"
    trainer.base[name] = trainer.base[name].t().contiguous()  # (128, 64) where the model has (64, 128)
    with ConformanceServer(TINY, **SERVER) as srv:
        with pytest.raises(TransferError, match=r"trailing dims differ.*down_proj.*\(128, 64\), \(128,\)"):
            Driver(emitter_for(srv), policy_versions()).sync(trainer, 1)
        assert srv.dead is None
        assert all(name not in b for p, b in srv.engine.calls if p == UPDATE)


def test_adapter_bytes_that_differ_from_the_tensors_never_leave(monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = Trainer()
    real = sglang.pack

    def corrupting_pack(flat, entries, tensors) -> None:
        real(flat, entries, tensors)
        flat[entries[-1].offset] ^= 0xFF

    with ConformanceServer(TINY, **SERVER) as srv:
        driver = Driver(emitter_for(srv), policy_versions())
        driver.sync(trainer, 1)
        monkeypatch.setattr(sglang, "pack", corrupting_pack)
        with pytest.raises(TransferError, match="packed bytes of .* differ from the tensor"):
            driver.sync(trainer, 2)
        assert len(calls(srv, LOAD)) == 1 and srv.dead is None


def test_a_resume_without_a_release_is_never_sent() -> None:
    with ConformanceServer(TINY, enable_memory_saver=True, **SERVER) as srv:
        emitter = emitter_for(srv)
        with pytest.raises(TransferError, match="resume_kv_cache without release_kv_cache"):
            emitter.resume_kv_cache()
        assert srv.dead is None and calls(srv, "/resume_memory_occupation") == []


# ---------------------------------------------------------------- 1: the encoding follows where the engine is


class _CudaLooking(torch.Tensor):
    """A CPU tensor that says it lives on a GPU, so the CUDA branch runs on a machine without one."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    def cpu(self) -> torch.Tensor:  # type: ignore[override]
        return self.as_subclass(torch.Tensor).clone()


def test_a_gpu_bucket_for_an_engine_that_cannot_open_it_goes_as_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = Trainer()
    real = sglang.pack_bucket

    def gpu_bucket(entries, tensors) -> sglang.Bucket:
        bucket = real(entries, tensors)
        return sglang.Bucket(bucket.flat.as_subclass(_CudaLooking), bucket.metadata)

    with ConformanceServer(TINY, **SERVER) as srv:  # a CPU engine: it can open no CUDA handle
        emitter = emitter_for(srv)
        monkeypatch.setattr(sglang, "pack_bucket", gpu_bucket)
        Driver(emitter, policy_versions()).sync(trainer, 1)
        assert srv.dead is None and emitter._colocated == {0: False}
        assert_parity(emitter.client, trainer, "policy-v1")


def test_only_a_local_cuda_engine_that_sees_the_gpu_is_colocated() -> None:
    from titan_lora.clients import sglang_checks  # imported here: the module is new with this rule

    info = sglang_api.ServerInfo("0.5.23", True, 8, None, None, 4, 1, 1, device="cuda")
    assert sglang_checks._is_local("127.0.0.1") and not sglang_checks._is_local("192.0.2.7")
    assert sglang_checks.engine_sees_gpu("192.0.2.7", 30000, info, 0) is False  # another host
    cpu = dataclasses.replace(info, device="cpu")
    assert sglang_checks.engine_sees_gpu("127.0.0.1", 30000, cpu, 0) is False
    assert sglang_checks.engine_sees_gpu("127.0.0.1", 1, info, 0) is False  # nobody listens there


# ---------------------------------------------------------------- 3: SGLang's q/k/v and gate/up fusing


@pytest.mark.parametrize("targets", [["v_proj"], ["k_proj", "v_proj"], ["q_proj"], ["up_proj"]])
def test_targets_sglang_cannot_fuse_are_refused_naming_the_fix(targets: list[str]) -> None:
    trainer = Trainer(targets=targets)
    with ConformanceServer(TINY, **SERVER) as srv:
        driver = Driver(emitter_for(srv), policy_versions())
        with pytest.raises(TransferError, match=r"cannot serve an adapter on .*add the missing modules"):
            driver.sync(trainer, 1)
        assert calls(srv, LOAD) == [] and srv.dead is None


def test_the_conformance_server_mirrors_sglangs_fusing_failures() -> None:
    with ConformanceServer(TINY, **SERVER) as srv:
        emitter = emitter_for(srv)
        Driver(emitter, policy_versions()).sync(Trainer(), 1)
        for targets, name in ((["q_proj"], "q-only"), (["v_proj"], "v-only")):
            payload = dataclasses.replace(Trainer(targets=targets).step(2), name=name)
            [entries] = sglang.plan_buckets(payload.tensors, 1 << 30)
            bucket = sglang.pack_bucket(entries, payload.tensors)
            res = emitter.client.load_lora_adapter_from_tensors(sglang_api.LoadLoRAAdapterFromTensorsReqInput(
                name, sglang_checks.sglang_adapter_config(payload.peft_config),
                sglang.serialize_for_ranks(bucket.payload(), 1, cuda=False), load_format="flattened_bucket"))
            if name == "q-only":
                assert not res.success and res.message.startswith("KeyError('") and "v_proj" in res.message
            else:
                assert res.success  # it loads, and the first request on it ends the server
        with pytest.raises(SGLangError, match="broke during /generate"):
            emitter.client.generate(PROMPT, "v-only", GREEDY)
        assert "never stacked" in srv.dead


# ---------------------------------------------------------------- 4: two API keys, each where it belongs


def test_api_key_and_admin_api_key_each_go_where_sglang_takes_them() -> None:
    trainer = Trainer()
    with ConformanceServer(TINY, api_key="user", admin_api_key="admin", **SERVER) as srv:
        emitter = emitter_for(srv, api_key="user", admin_api_key="admin")
        Driver(emitter, policy_versions()).sync(trainer, 1)
        assert_parity(emitter.client, trainer, "policy-v1")
        # The split of utils/auth.py: each key is refused on the other's routes.
        assert _post(srv, "/unload_lora_adapter", {"lora_name": "policy-v1"}, "user")[0] == 401
        assert _post(srv, "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}},
                     "admin")[0] == 401
        only_user = emitter_for(srv, api_key="user")
        with pytest.raises(TransferError, match="401.*set \\[engine\\] admin_api_key"):
            only_user.send_base(trainer.base, 2)
        assert only_user.engine_limits().max_lora_rank == 8  # /server_info takes the normal key


# ---------------------------------------------------------------- 5: names the loader would skip silently


def test_a_base_name_the_server_lacks_is_refused_not_skipped() -> None:
    trainer = Trainer()
    trainer.base["model.layers.0.mlp.down_projj.weight"] = torch.zeros(64, 128)
    with ConformanceServer(TINY, **SERVER) as srv:
        with pytest.raises(TransferError, match=r"serves no parameter named \['model.layers.0.mlp.down_projj"):
            Driver(emitter_for(srv), policy_versions()).sync(trainer, 1)
        assert srv.engine.skipped == [] and srv.engine.weight_version == "default"


def test_a_base_the_server_did_not_apply_is_caught_by_reading_a_sample_back() -> None:
    trainer = Trainer()
    with ConformanceServer(TINY, **SERVER) as srv:
        real = srv.engine.update_base

        def loader_that_drops_embeddings(body: dict) -> dict:  # a remap the flip of the version hides
            srv.engine.params = {k: v for k, v in srv.engine.params.items() if "embed" not in k}
            try:
                return real(body)
            finally:
                srv.engine.params = srv.engine.model.state_dict()

        emitter = emitter_for(srv)
        emitter._check_base_names = lambda entries: None  # names pass; the apply is what fails
        srv.engine.update_base = loader_that_drops_embeddings
        with pytest.raises(TransferError, match="serves model.embed_tokens.weight differently"):
            Driver(emitter, policy_versions()).sync(trainer, 1)
        assert srv.engine.weight_version.endswith("-base-v1"), "the version flipped all the same"


# ---------------------------------------------------------------- 6: a retired name reloads implicitly, and stalls


def test_a_retired_name_is_never_sent_to_generate() -> None:
    with ConformanceServer(TINY, reload_stall_s=5.0, **SERVER) as srv:
        emitter = emitter_for(srv)
        Driver(emitter, policy_versions()).sync(Trainer(), 1)
        assert emitter.retire_adapter("policy-v1", 5.0)
        with pytest.raises(SGLangError, match="'policy-v1' was retired"):
            emitter.client.generate(PROMPT, "policy-v1", GREEDY, timeout_s=1.0)
        assert calls(srv, "/generate") == []
        raw = SGLangClient(srv.url, retries=0)  # a client that does not know: the server stalls
        with pytest.raises(sglang_api.SGLangTimeout):
            raw.generate(PROMPT, "policy-v1", GREEDY, timeout_s=0.5)


# ---------------------------------------------------------------- 7: release_memory_occupation


def test_memory_release_needs_the_memory_saver_and_an_idle_server() -> None:
    with ConformanceServer(TINY, **SERVER) as srv:
        with pytest.raises(TransferError, match="without --enable-memory-saver.*restart it with that flag"):
            emitter_for(srv).release_kv_cache()
        assert calls(srv, "/release_memory_occupation") == []
    with ConformanceServer(TINY, enable_memory_saver=True, **SERVER) as srv:
        emitter = emitter_for(srv, timeout_s=0.5)
        with srv.engine.hold(None):  # a request in flight: SGLang asserts idleness and would die
            with pytest.raises(TransferError, match="still runs requests"):
                emitter.release_kv_cache()
        assert srv.dead is None and calls(srv, "/release_memory_occupation") == []
        emitter.release_kv_cache()
        emitter.resume_kv_cache()
        assert srv.engine.released == [["kv_cache"], ["kv_cache"]]


# ---------------------------------------------------------------- 8: an incomplete unload after a partial TP load


def test_a_load_that_failed_on_some_ranks_is_unloaded_and_loaded_again() -> None:
    trainer = Trainer()
    with ConformanceServer(TINY, tp_size=2, partial_load_failures=1, **SERVER) as srv:
        emitter = emitter_for(srv)
        driver = Driver(emitter, policy_versions())
        with pytest.raises(TransferError, match="on tp rank 1"):
            driver.sync(trainer, 1)
        assert "policy-v1" in srv.engine.incomplete
        payload = trainer.step(1)
        ack = emitter.send_adapter(payload)  # the syncer's retry of the same version
        assert ack.num_tensors == payload.num_tensors
        assert calls(srv, LOAD, "/unload_lora_adapter")[-3:] == [LOAD, "/unload_lora_adapter", LOAD]
        assert_parity(emitter.client, trainer, "policy-v1")


# ---------------------------------------------------------------- 9: DP attention, peft_type, slots, null log-probs


def test_a_dp_attention_server_is_refused_naming_its_flag() -> None:
    with ConformanceServer(TINY, dp_size=2, enable_dp_attention=True, **SERVER) as srv:
        with pytest.raises(TransferError, match=r"attn_dp_size=2.*only pinned.*no --enable-dp-attention"):
            emitter_for(srv).engine_limits()


def test_an_adapter_config_without_peft_type_is_sent_as_lora() -> None:
    trainer = Trainer()
    with ConformanceServer(TINY, **SERVER) as srv:
        emitter = emitter_at_v1(srv, trainer)
        payload = trainer.step(2)
        config = {k: v for k, v in payload.peft_config.items() if k != "peft_type"}
        emitter.send_adapter(dataclasses.replace(payload, peft_config=config))
        assert srv.dead is None
        assert [b["config_dict"]["peft_type"] for p, b in srv.engine.calls if p == LOAD] == ["LORA", "LORA"]


def test_max_loras_per_batch_keeps_a_slot_for_base_only_requests() -> None:
    with ConformanceServer(TINY, **{**SERVER, "max_loras_per_batch": 3}) as srv:
        with pytest.raises(TransferError, match="plus one for base-only requests.*--max-loras-per-batch 4"):
            emitter_for(srv, keep_versions=2).engine_limits()


class _NullLogprob(Answering):
    """An SGLang /generate answer whose -inf log-probs orjson wrote as null."""

    def answer(self, body: bytes) -> object:
        meta = {"output_token_logprobs": [[-0.5, 3, None], [None, 9, None]],
                "input_token_logprobs": [[None, 1, None], [None, 2, None]], "finish_reason": None}
        return {"text": "", "output_ids": [3, 9], "meta_info": meta}


def test_a_null_log_prob_reads_as_minus_infinity() -> None:
    with serving(_NullLogprob) as url:
        out = SGLangClient(url, retries=0).generate([1, 2], None, GREEDY, logprob_start_len=0)
        assert out.output_logprobs == [-0.5, -math.inf]
        assert out.input_logprobs == [None, -math.inf]  # only the first prompt token has none


# ---------------------------------------------------------------- unknown fields: SGLang ignores them


def test_our_request_bodies_use_only_0_5_23_field_names() -> None:
    bodies = {"/begin_weight_update": sglang_api.BeginWeightUpdateReqInput,
              "/end_weight_update": sglang_api.EndWeightUpdateReqInput,
              UPDATE: sglang_api.UpdateWeightsFromTensorReqInput, LOAD: sglang_api.LoadLoRAAdapterFromTensorsReqInput,
              "/unload_lora_adapter": sglang_api.UnloadLoRAAdapterReqInput,
              "/pause_generation": sglang_api.PauseGenerationReqInput,
              "/continue_generation": sglang_api.ContinueGenerationReqInput,
              "/release_memory_occupation": sglang_api.MemoryOccupationReqInput,
              "/get_weights_by_name": sglang_api.GetWeightsByNameReqInput,
              "/generate": sglang_api.GenerateReqInput}
    for path, cls in bodies.items():
        required, optional = SCHEMAS[path]
        assert {f.name for f in dataclasses.fields(cls)} <= {*required, *optional}, path


def test_the_conformance_server_ignores_unknown_top_level_fields_as_sglang_does() -> None:
    with ConformanceServer(TINY, **SERVER) as srv:
        status, out = _post(srv, "/unload_lora_adapter", {"lora_name": "x", "lora_nmae": "y"})
        assert status == 400 and out["error_message"].startswith("LoRA with name x does not exist")
        assert srv.engine.ignored == ["/unload_lora_adapter:lora_nmae"]
