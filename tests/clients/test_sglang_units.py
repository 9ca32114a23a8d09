"""The SGLang emitter's own logic against a scripted client (no HTTP): limits and their messages, the
base session's call order and flags, the adapter request, retirement, and the payload format. The
conformance tests (test_sglang*.py) check the same emitter against a server built from SGLang's source;
these pin the branches and messages one by one, with values written out by hand."""

from __future__ import annotations

import base64
import hashlib
import itertools
import logging
import pickle
import types

import pytest
import torch

from titan_lora.clients import sglang
from titan_lora.clients.base import AdapterPayload, Endpoint
from titan_lora.clients.sglang import (
    SGLangEmitter,
    adapter_modules,
    check_adapter,
    check_server,
    pack_bucket,
    serialize_for_ranks,
    served_modules,
    sglang_adapter_config,
)
from titan_lora.clients.sglang_api import ControlResult, ServerInfo, SGLangTimeout
from titan_lora.config import Engine, WeightSync
from titan_lora.transfer.buckets import plan_buckets
from titan_lora.transfer.errors import EngineWeightsLost, TransferError
from titan_lora.transfer.protocol import EngineLimits

URL = "http://sglang.test:30000"
OK = ControlResult(True, "ok")


def info(**overrides) -> ServerInfo:  # noqa: ANN003
    base = dict(version="0.5.23", enable_lora=True, max_lora_rank=16,
                lora_target_modules=frozenset({"q_proj", "v_proj"}), max_loaded_loras=4, max_loras_per_batch=4,
                tp_size=2, dp_size=1, enable_memory_saver=True)
    return ServerInfo(**{**base, **overrides})


class Client:
    """SGLangClient stand-in: records each call; answers from attributes the test sets."""

    url, timeout_s = URL, 42.0

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.info = info()
        self.served = "launch-version"  # the weight_version the server reports
        self.begin = [OK]
        self.end = OK
        self.update: list[ControlResult] = []
        self.load: list[ControlResult] = []
        self.unload: list[object] = []
        self.flushed = True
        self.weights = dict(BASE)  # what /get_weights_by_name reads; absent: SGLang answers None
        self.probes: list[tuple[str, int]] = []  # get_weights_by_name calls, kept out of `calls`

    def server_info(self) -> ServerInfo:
        self.calls.append(("server_info",))
        return self.info

    def weight_version(self) -> str:
        self.calls.append(("weight_version",))
        return self.served

    def begin_weight_update(self) -> ControlResult:
        self.calls.append(("begin",))
        return self.begin.pop(0) if len(self.begin) > 1 else self.begin[0]

    def end_weight_update(self) -> ControlResult:
        self.calls.append(("end",))
        return self.end

    def update_weights_from_tensor(self, req) -> ControlResult:  # noqa: ANN001
        self.calls.append(("update", req))
        if req.weight_version is not None:
            self.served = req.weight_version
        return self.update.pop(0) if self.update else OK

    def load_lora_adapter_from_tensors(self, req) -> ControlResult:  # noqa: ANN001
        self.calls.append(("load", req))
        if self.load:
            return self.load.pop(0)
        return ControlResult(True, "loaded", {req.lora_name: "x"})

    def unload_lora_adapter(self, lora_name: str, timeout_s: float) -> ControlResult:
        self.calls.append(("unload", lora_name, timeout_s))
        answer = self.unload.pop(0) if self.unload else OK
        if isinstance(answer, Exception):
            raise answer
        return answer

    def get_weights_by_name(self, name: str, truncate_size: int) -> list | None:
        self.probes.append((name, truncate_size))
        return self.weights[name][:truncate_size].tolist() if name in self.weights else None

    def pause_generation(self, mode: str) -> None:
        self.calls.append(("pause", mode))

    def continue_generation(self) -> None:
        self.calls.append(("continue",))

    def flush_cache(self, wait_idle_s: float = 0.0) -> bool:
        self.calls.append(("flush", wait_idle_s))
        return self.flushed

    def release_kv_cache(self) -> None:
        self.calls.append(("release_kv",))

    def resume_kv_cache(self) -> None:
        self.calls.append(("resume_kv",))

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


BASE = {"model.embed_tokens.weight": torch.arange(8.0).view(2, 4), "model.norm.weight": torch.ones(4)}


def adapter(name: str = "policy-v1", r: int = 8) -> AdapterPayload:
    tensors = {f"base_model.model.model.layers.0.self_attn.{m}.lora_{ab}.weight": t
               for m in ("q_proj", "v_proj") for ab, t in (("A", torch.ones(r, 4)), ("B", torch.zeros(4, r)))}
    return AdapterPayload(name, 1, tensors, {"r": r, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]})


def emitter(client: Client, **kwargs) -> SGLangEmitter:  # noqa: ANN003
    return SGLangEmitter(client, keep_versions=2, **kwargs)


def own(caplog: pytest.LogCaptureFixture, *markers: str) -> list[str]:
    """The emitter's log lines that carry one of `markers` (other tests' background retirers may also log)."""
    return [r.getMessage() for r in caplog.records
            if r.name == "titan_lora.clients.sglang" and any(m in r.getMessage() for m in markers)]


# ---- check_server, served_modules, check_adapter, adapter_modules, the config -------------------------


def test_limits_are_the_smaller_slot_count_and_the_served_modules() -> None:
    limits = check_server(info(), URL, keep_versions=2)
    assert limits == EngineLimits(16, 3, frozenset({"q_proj", "k_proj", "v_proj", "qkv_proj"}))
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


def test_cpu_payloads_are_plain_pickles_one_per_rank() -> None:
    obj = {"flattened_tensor": torch.arange(4, dtype=torch.uint8), "metadata": [types.SimpleNamespace(name="x")]}
    out = serialize_for_ranks(obj, 3, cuda=False)
    assert len(out) == 3 and out[0] == out[1] == out[2]
    back = pickle.loads(base64.b64decode(out[0]))
    assert torch.equal(back["flattened_tensor"], obj["flattened_tensor"]) and back["metadata"][0].name == "x"
    assert out[0].isascii()


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


# ---- send_base ---------------------------------------------------------------------------------------


def test_the_base_is_one_session_whose_last_bucket_flips_the_version_and_flushes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    client = Client()
    em = emitter(client, bucket_bytes=32)  # the 32-byte embedding, then the norm: two buckets
    serialized: list[tuple] = []
    real = sglang.serialize_for_ranks
    monkeypatch.setattr(sglang, "serialize_for_ranks",
                        lambda obj, tp, cuda: serialized.append((tp, cuda)) or real(obj, tp, cuda))
    ack = em.send_base(BASE, version=5)
    assert serialized == [(2, False), (2, False)]
    assert client.names() == ["server_info", "begin", "update", "update", "end", "weight_version"]
    first, last = client.calls[2][1], client.calls[3][1]
    token = client.served
    assert token.startswith("titan-lora-") and token.endswith("-base-v5") and len(token) == len("titan-lora--base-v5") + 12
    assert (first.weight_version, first.flush_cache, last.weight_version, last.flush_cache) == (None, False, token, True)
    assert first.load_format == last.load_format == "flattened_bucket" and len(first.serialized_named_tensors) == 2
    assert (ack.version, ack.num_tensors, ack.nbytes) == (5, 2, 48) and set(ack.phases_ms) == {"base_ms"}
    assert em.engine_incarnation() == token and em._installed == token


def test_each_emitter_marks_its_own_base(monkeypatch: pytest.MonkeyPatch) -> None:
    one, two = Client(), Client()
    emitter(one).send_base(BASE, 1)
    emitter(two).send_base(BASE, 1)
    assert one.served != two.served


@pytest.mark.parametrize("mode", ["abort", "retract"])
def test_a_pausing_base_update_pauses_then_continues(mode: str) -> None:
    client = Client()
    emitter(client, pause_mode=mode).send_base(BASE, 1)
    assert client.names() == ["server_info", "pause", "begin", "update", "end", "continue", "weight_version"]
    assert client.calls[1] == ("pause", mode) and client.calls[3][1].flush_cache is True


def test_an_in_place_update_keeps_requests_and_flushes_after_they_drain(caplog: pytest.LogCaptureFixture) -> None:
    client = Client()
    emitter(client, pause_mode="in_place").send_base(BASE, 1)
    assert client.names() == ["server_info", "pause", "begin", "update", "end", "continue", "flush",
                              "weight_version"]
    assert client.calls[3][1].flush_cache is False and client.calls[6] == ("flush", 42.0)
    client = Client()
    client.flushed = False
    with caplog.at_level(logging.WARNING, logger="titan_lora.clients.sglang"):
        emitter(client, pause_mode="in_place").send_base(BASE, 1)
    assert own(caplog, "prefix cache") == ["SGLang kept its prefix cache after the base update (requests never drained); "
                               "cached prefixes computed with the old base may be reused"]


def test_a_session_left_open_is_closed_and_reopened(caplog: pytest.LogCaptureFixture) -> None:
    client = Client()
    client.begin = [ControlResult(False, "a weight update is already open"), OK]
    with caplog.at_level(logging.WARNING, logger="titan_lora.clients.sglang"):
        emitter(client).send_base(BASE, 1)
    assert client.names()[:4] == ["server_info", "begin", "end", "begin"]
    assert own(caplog, URL) == [f"closing a weight-update session left open on {URL}"]


def test_a_session_that_cannot_open_is_an_error() -> None:
    client = Client()
    client.begin = [ControlResult(False, "busy")]
    with pytest.raises(TransferError) as err:
        emitter(client).send_base(BASE, 1)
    assert str(err.value) == "SGLang could not open a weight-update session: busy"
    assert client.names() == ["server_info", "begin"]


def test_a_refused_bucket_still_closes_the_session() -> None:
    client = Client()
    client.update = [ControlResult(False, "shape mismatch")]
    with pytest.raises(TransferError) as err:
        emitter(client, bucket_bytes=32).send_base(BASE, 3)
    assert str(err.value) == "SGLang refused base bucket 1 of version 3: shape mismatch"
    assert client.names() == ["server_info", "begin", "update", "end"]


def test_a_session_that_does_not_close_is_an_error() -> None:
    client = Client()
    client.end = ControlResult(False, "still loading")
    with pytest.raises(TransferError) as err:
        emitter(client).send_base(BASE, 4)
    assert str(err.value) == "SGLang could not close the weight update of version 4: still loading"


def test_an_empty_base_and_a_version_that_did_not_flip_are_errors() -> None:
    with pytest.raises(TransferError) as err:
        emitter(Client()).send_base({}, 2)
    assert str(err.value) == "send_base of version 2 got no tensors"

    class Stuck(Client):
        def update_weights_from_tensor(self, req) -> ControlResult:  # noqa: ANN001
            self.calls.append(("update", req))
            return OK  # acknowledged, but the served version does not change

    client = Stuck()
    em = emitter(client)
    with pytest.raises(TransferError) as err:
        em.send_base(BASE, 2)
    assert str(err.value) == (f"SGLang acknowledged base version 2 but serves weight_version 'launch-version', not "
                              f"'titan-lora-{em._token}-base-v2': the update did not take effect")
    assert em._installed is None


# ---- send_adapter and retire_adapter -----------------------------------------------------------------


def test_an_adapter_before_our_base_is_weights_lost() -> None:
    client = Client()
    with pytest.raises(EngineWeightsLost) as err:
        emitter(client).send_adapter(adapter())
    assert str(err.value) == (f"SGLang at {URL} serves weight_version 'launch-version', not the base this trainer "
                              "sent (None): send the base first")
    em = emitter(client)
    em.send_base(BASE, 1)
    client.served = "launch-version"  # restarted
    with pytest.raises(EngineWeightsLost):
        em.send_adapter(adapter())


def test_the_adapter_request_and_its_ack(monkeypatch: pytest.MonkeyPatch) -> None:
    client = Client()
    em = emitter(client)
    em.send_base(BASE, 1)
    client.calls.clear()
    serialized: list[tuple] = []
    real = sglang.serialize_for_ranks
    monkeypatch.setattr(sglang, "serialize_for_ranks",
                        lambda obj, tp, cuda: serialized.append((tp, cuda)) or real(obj, tp, cuda))
    clock = itertools.count(100)
    monkeypatch.setattr(sglang.time, "perf_counter", lambda: float(next(clock)))
    payload = adapter()
    ack = em.send_adapter(payload)
    assert client.names() == ["weight_version", "load"], "the limits read with the base are reused"
    req = client.calls[1][1]
    assert req.lora_name == "policy-v1" and req.load_format == "flattened_bucket"
    assert req.config_dict == {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"],
                               "peft_type": "LORA"}
    assert serialized == [(2, False)] and len(req.serialized_named_tensors) == 2
    assert set(req.expected_checksums) == set(payload.tensors)
    assert (ack.version, ack.num_tensors, ack.nbytes) == (1, 4, payload.nbytes)
    assert ack.phases_ms == {"pack_ms": 1e3, "serialize_ms": 1e3, "transfer_apply_ms": 1e3}


def test_without_verification_no_checksums_are_sent() -> None:
    client = Client()
    em = emitter(client, verify_checksums=False)
    em.send_base(BASE, 1)
    em.send_adapter(adapter())
    assert client.calls[-1][1].expected_checksums is None


def test_an_adapter_the_server_cannot_hold_is_refused_naming_the_server() -> None:
    client = Client()
    em = emitter(client)
    em.send_base(BASE, 1)
    with pytest.raises(TransferError, match=f"^SGLang at {URL} serves LoRA rank <= 16, the adapter has rank 32"):
        em.send_adapter(adapter(r=32))


def test_a_stale_copy_is_unloaded_and_the_adapter_loaded_again(caplog: pytest.LogCaptureFixture) -> None:
    client = Client()
    em = emitter(client)
    em.send_base(BASE, 1)
    client.calls.clear()
    client.load = [ControlResult(False, "adapter unit-v1 is already loaded")]
    with caplog.at_level(logging.WARNING, logger="titan_lora.clients.sglang"):
        em.send_adapter(adapter("unit-v1"))
    assert client.names() == ["weight_version", "load", "unload", "load"]
    assert client.calls[2] == ("unload", "unit-v1", 42.0)
    assert own(caplog, "unit-v1") == ["SGLang holds unit-v1 (adapter unit-v1 is already loaded); unloading it "
                                      "and loading again"]


def test_a_refused_load_is_an_error_and_nothing_is_unloaded() -> None:
    client = Client()
    em = emitter(client)
    em.send_base(BASE, 1)
    client.load = [ControlResult(False, "out of memory")]
    with pytest.raises(TransferError) as err:
        em.send_adapter(adapter())
    assert str(err.value) == "SGLang refused adapter policy-v1: out of memory"
    assert "unload" not in client.names()


def test_a_load_that_does_not_list_the_adapter_is_an_error() -> None:
    client = Client()
    em = emitter(client)
    em.send_base(BASE, 1)
    client.load = [ControlResult(True, "ok", {"policy-v0": "x"})]
    with pytest.raises(TransferError) as err:
        em.send_adapter(adapter())
    assert str(err.value) == ("SGLang acknowledged adapter policy-v1 but does not list it as loaded (loaded: "
                              "['policy-v0'])")


def test_retirement_outcomes(caplog: pytest.LogCaptureFixture) -> None:
    client = Client()
    em = emitter(client)
    client.unload = [OK, ControlResult(False, "lora unit-v3 does not exist"),
                     ControlResult(False, "in use by 2 requests"), SGLangTimeout("timed out")]
    with caplog.at_level(logging.WARNING, logger="titan_lora.clients.sglang"):
        assert em.retire_adapter("unit-v2", 5.0) is True
        assert em.retire_adapter("unit-v3", 5.0) is True, "already gone counts as retired"
        assert em.retire_adapter("unit-v4", 5.0) is False
        assert em.retire_adapter("unit-v5", 2.5) is False
    assert client.calls == [("unload", "unit-v2", 5.0), ("unload", "unit-v3", 5.0),
                            ("unload", "unit-v4", 5.0), ("unload", "unit-v5", 2.5)]
    assert own(caplog, "unit-v") == [
        "SGLang refused to unload unit-v4: in use by 2 requests",
        f"unloading unit-v5 on {URL} took over 2.5s; the server keeps working on it",
    ]


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
    # an empty [engine] url never gets here: preflight refuses it (tests/trainer/test_config_errors.py)


def test_a_bucket_is_packed_on_its_tensors_device() -> None:
    tensors = {"a": torch.empty(4, device="meta"), "b": torch.empty(2, device="meta")}
    (entries,) = plan_buckets(tensors, 1 << 20)
    assert pack_bucket(entries, tensors).flat.device.type == "meta"


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


def test_the_servers_limits_are_checked_naming_its_address() -> None:
    client = Client()
    client.info = info(enable_lora=False)
    with pytest.raises(TransferError, match=f"^SGLang at {URL} was started without LoRA"):
        emitter(client).engine_limits()


def test_a_flushed_in_place_update_warns_nothing_and_the_base_time_is_milliseconds(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = itertools.count(100)
    monkeypatch.setattr(sglang.time, "perf_counter", lambda: float(next(clock)))
    with caplog.at_level(logging.WARNING, logger="titan_lora.clients.sglang"):
        ack = emitter(Client(), pause_mode="in_place").send_base(BASE, 1)
    assert own(caplog, "prefix cache") == []
    assert ack.phases_ms == {"base_ms": 1e3}, "read at 100 and 101"
