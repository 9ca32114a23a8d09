"""The SGLang emitter against the conformance server (CPU, a small random Llama, PEFT adapters)."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import pickle
import socket
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
import torch.multiprocessing  # torch's reducers on ForkingPickler
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from scripted_sglang import serving
from sglang_conformance import ConformanceServer, decode_tensors
from transformers import LlamaConfig, LlamaForCausalLM

from titan_lora.clients.base import AdapterPayload, Endpoint
from titan_lora.clients.kinds import engine_kind
from titan_lora.clients.sglang import SGLangEmitter, pack_bucket, serialize_for_ranks
from titan_lora.clients.sglang_api import LoadLoRAAdapterFromTensorsReqInput, SGLangClient, SGLangError
from titan_lora.clients.sglang_checks import sglang_adapter_config
from titan_lora.config import Engine, WeightSync
from titan_lora.sync.retire import Retirer
from titan_lora.sync.versions import AdapterVersions, versioned_name
from titan_lora.transfer.buckets import plan_buckets
from titan_lora.transfer.errors import EngineWeightsLost, TransferError

TINY = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
TARGETS = ["q_proj", "v_proj", "down_proj"]
PROMPT = [5, 17, 42, 99, 3, 64, 7]
GREEDY = {"max_new_tokens": 4, "temperature": 0}
SERVER = {"max_lora_rank": 8, "lora_target_modules": TARGETS, "max_loaded_loras": 3, "max_loras_per_batch": 4}


class Trainer:
    """Rank 0 of a trainer, in miniature: fixed base weights and a PEFT adapter that changes every step."""

    def __init__(self, r: int = 4, use_rslora: bool = False, seed: int = 0,
                 base: LlamaForCausalLM | None = None, targets: list[str] = TARGETS) -> None:
        torch.manual_seed(seed)
        base = LlamaForCausalLM(TINY).eval() if base is None else base
        self.base = {k: v.clone() for k, v in base.state_dict().items()}
        lora = LoraConfig(r=r, lora_alpha=2.0 * r, use_rslora=use_rslora, target_modules=targets)
        self.model = get_peft_model(base, lora).eval()
        self.gen = torch.Generator().manual_seed(seed)
        # PEFT's export names (adapter name dropped) -> live parameters; cheaper than re-exporting per step.
        params = dict(self.model.named_parameters())
        exported = get_peft_model_state_dict(self.model)
        self.lora = {n: params[n.replace(".weight", ".default.weight")] for n in exported}

    def step(self, version: int) -> AdapterPayload:
        """An optimizer step (new random adapter weights) and its export in PEFT naming."""
        with torch.no_grad():
            for p in self.lora.values():
                p.copy_(torch.randn(p.shape, generator=self.gen) * 0.3)
        tensors = {name: p.detach().clone() for name, p in self.lora.items()}
        config = self.model.peft_config["default"].to_dict()
        return AdapterPayload(versioned_name("policy", version), version, tensors, config)

    @torch.no_grad()
    def token_logprobs(self, ids: list[int], adapter: bool = True) -> torch.Tensor:
        """log p(ids[i] | ids[:i]) for i >= 1, with or without the adapter."""
        ctx = contextlib.nullcontext() if adapter else self.model.disable_adapter()
        with ctx:
            lp = torch.log_softmax(self.model(torch.tensor([ids])).logits[0].float(), -1)
        return lp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


class Driver:
    """The syncer's ordering in miniature: base first per engine incarnation, publish only acked names."""

    def __init__(self, emitter, versions: AdapterVersions, retirer: Retirer | None = None) -> None:
        self.emitter, self.versions, self.retirer = emitter, versions, retirer
        self.incarnation: str | None = None

    def sync(self, trainer: Trainer, version: int) -> None:
        if self.emitter.engine_incarnation() != self.incarnation:
            self.versions.forget_all()
            self.emitter.send_base(trainer.base, version)
            self.incarnation = self.emitter.engine_incarnation()
        payload = trainer.step(version)
        ack = self.emitter.send_adapter(payload)
        assert (ack.version, ack.num_tensors, ack.nbytes) == (version, payload.num_tensors, payload.nbytes)
        self.versions.publish(version)
        if self.retirer is not None:
            self.retirer.schedule_expired()


def emitter_for(srv: ConformanceServer, api_key: str = "", admin_api_key: str = "", pause_mode: str = "none",
                **cfg):
    """The registered SGLang emitter, built from [engine] and [weight_sync] the way the composition root does."""
    ws = WeightSync(**{"enabled": True, "timeout_s": 10.0, "retries": 1, **cfg})
    engine = Engine(kind="sglang", url=srv.url, api_key=api_key, admin_api_key=admin_api_key, pause_mode=pause_mode)
    return engine_kind("sglang").emitter(ws, engine, Endpoint(engine.url, engine.api_key))


UPDATE, LOAD = "/update_weights_from_tensor", "/load_lora_adapter_from_tensors"


def policy_versions() -> AdapterVersions:
    """The retention window the tests sync under: "policy", two live versions."""
    return AdapterVersions("policy", keep_versions=2)


def emitter_at_v1(srv: ConformanceServer, trainer: Trainer) -> SGLangEmitter:
    """An emitter whose server already holds the base and version 1 of `trainer`."""
    emitter = emitter_for(srv)
    Driver(emitter, policy_versions()).sync(trainer, 1)
    return emitter


def calls(srv: ConformanceServer, *paths: str) -> list[str]:
    return [p for p, _ in srv.engine.calls if not paths or p in paths]


def assert_parity(client: SGLangClient, trainer: Trainer, name: str, tolerance: float = 1e-3) -> None:
    """Served prompt and output log-probs equal the trainer's own, and the adapter visibly matters."""
    out = client.generate(PROMPT, name, GREEDY, logprob_start_len=0)
    full = PROMPT + out.output_ids
    served = torch.tensor(out.input_logprobs[1:] + out.output_logprobs)
    assert (served - trainer.token_logprobs(full)).abs().max() <= tolerance
    assert (served - trainer.token_logprobs(full, adapter=False)).abs().max() > 0.05  # the test can fail


@pytest.mark.parametrize("use_rslora, tp_size", [(False, 1), (True, 2)])
def test_served_logprobs_match_the_trainer_after_every_sync(use_rslora: bool, tp_size: int) -> None:
    trainer = Trainer(use_rslora=use_rslora)
    with ConformanceServer(TINY, api_key="sekret", tp_size=tp_size, **SERVER) as srv:
        emitter = emitter_for(srv, api_key="sekret")
        assert emitter.engine_limits().max_lora_rank == 8
        versions = AdapterVersions("policy", keep_versions=2)
        driver = Driver(emitter, versions)
        for step in (1, 2, 3):
            driver.sync(trainer, step)
            assert_parity(emitter.client, trainer, versions.active.name)
        load = next(body for path, body in srv.engine.calls if path == "/load_lora_adapter_from_tensors")
        assert load["load_format"] == "flattened_bucket" and len(load["expected_checksums"]) == 12
        assert load["config_dict"].get("use_rslora") is False


def test_adapter_before_base_is_refused() -> None:
    trainer = Trainer()
    with ConformanceServer(TINY, **SERVER) as srv:
        emitter = emitter_for(srv)
        with pytest.raises(EngineWeightsLost, match="send the base first"):
            emitter.send_adapter(trainer.step(1))
        assert calls(srv, "/load_lora_adapter_from_tensors") == []
        # And the engine side refuses a load that skips the base, whoever sends it.
        payload = trainer.step(1)
        bucket = pack_bucket(plan_buckets(payload.tensors, 1 << 30)[0], payload.tensors)
        res = emitter.client.load_lora_adapter_from_tensors(LoadLoRAAdapterFromTensorsReqInput(
            payload.name, sglang_adapter_config(payload.peft_config),
            serialize_for_ranks(bucket.payload(), 1, cuda=False), load_format="flattened_bucket"))
        assert not res.success and "base weights were never loaded" in res.message


def test_restart_makes_the_emitter_send_the_base_again_first() -> None:
    trainer = Trainer()
    with ConformanceServer(TINY, **SERVER) as srv:
        emitter = emitter_for(srv)
        versions = AdapterVersions("policy", keep_versions=2)
        driver = Driver(emitter, versions)
        driver.sync(trainer, 1)
        driver.sync(trainer, 2)
        srv.restart()
        with pytest.raises(EngineWeightsLost):
            emitter.send_adapter(trainer.step(3))
        assert calls(srv, "/load_lora_adapter_from_tensors") == []
        driver.sync(trainer, 3)
        order = calls(srv, "/update_weights_from_tensor", "/load_lora_adapter_from_tensors")
        assert order == ["/update_weights_from_tensor", "/load_lora_adapter_from_tensors"]
        assert versions.live == [3]
        assert_parity(emitter.client, trainer, versions.active.name)


def test_a_new_run_replaces_a_stale_adapter_under_the_same_name() -> None:
    with ConformanceServer(TINY, **SERVER) as srv:
        Driver(emitter_for(srv), AdapterVersions("policy", 2)).sync(Trainer(seed=0), 1)
        # The trainer restarts from an earlier checkpoint: same name, new weights, new emitter.
        trainer, versions = Trainer(seed=1), AdapterVersions("policy", 2)
        emitter = emitter_for(srv)
        Driver(emitter, versions).sync(trainer, 1)
        assert calls(srv, "/unload_lora_adapter") == ["/unload_lora_adapter"]
        assert_parity(emitter.client, trainer, versions.active.name)


@pytest.mark.parametrize("server, emitter_cfg, action, fix", [
    ({"enable_lora": False}, {}, "limits", "--enable-lora"),
    ({"max_lora_rank": 2}, {}, "sync", "--max-lora-rank 4"),
    ({"lora_target_modules": ["q_proj"]}, {}, "sync", "--lora-target-modules"),
    ({"max_loaded_loras": 2, "max_loras_per_batch": 2}, {"keep_versions": 2}, "limits",
     "--max-loaded-loras 3"),
    ({"max_loras_per_batch": 3}, {"keep_versions": 2}, "limits", "--max-loras-per-batch 4"),
    ({"api_key": "right"}, {"api_key": "wrong"}, "limits", "rejected the API key .*401"),
    ({"api_key": "right"}, {}, "limits", "requires an API key"),
])
def test_errors_name_the_fix(server: dict, emitter_cfg: dict, action: str, fix: str) -> None:
    trainer = Trainer(r=4)
    with ConformanceServer(TINY, **{**SERVER, "max_loaded_loras": None, **server}) as srv:
        emitter = emitter_for(srv, **emitter_cfg)
        with pytest.raises(TransferError, match=fix):
            if action == "limits":
                emitter.engine_limits()
            else:
                Driver(emitter, AdapterVersions("policy", 2)).sync(trainer, 1)
        assert calls(srv, "/load_lora_adapter_from_tensors") == []  # refused before sending


class WatchedVersions(AdapterVersions):
    """AdapterVersions that counts the retirements that had to wait for in-flight requests."""

    waited = 0

    def wait_drained(self, version: int, timeout_s: float) -> bool:
        self.waited += self.in_flight(version) > 0
        return super().wait_drained(version, timeout_s)


def test_200_syncs_with_requests_in_flight_keep_the_window() -> None:
    keep, cycles = 2, 200
    trainer = Trainer()
    # Every 8th request is slow and outlives several syncs, so expired versions still have requests.
    with ConformanceServer(TINY, gen_delays_s=(0.005,) * 7 + (0.15,), **SERVER) as srv:
        emitter = emitter_for(srv, keep_versions=keep)
        versions = WatchedVersions("policy", keep)
        retirer = Retirer(versions, emitter.retire_adapter, timeout_s=5.0)
        driver = Driver(emitter, versions, retirer)
        driver.sync(trainer, 0)
        stop, served, errors = threading.Event(), [], []

        def rollouts() -> None:
            while not stop.is_set():
                with versions.lease() as lease:
                    try:
                        emitter.client.generate(PROMPT, lease.name, {"max_new_tokens": 1, "temperature": 0})
                        served.append(lease.version)
                    except SGLangError as err:
                        errors.append(err)

        worker = threading.Thread(target=rollouts, daemon=True)  # one: more only add GIL contention
        worker.start()
        t0, most_live = time.monotonic(), 0
        for step in range(1, cycles):
            driver.sync(trainer, step)
            most_live = max(most_live, len(versions.live))
            assert retirer.wait_idle(10.0), "a retirement hung"
        stop.set()
        worker.join(10.0)
        elapsed = time.monotonic() - t0
        assert not errors and len(served) > 50  # every leased name was loaded on the server
        assert versions.waited >= 5  # the overlap this test is about did happen
        assert most_live <= keep + 1 and srv.engine.loaded_high_water <= keep + 1
        assert srv.engine.lru_evictions == 0 and srv.engine.blocked_unloads == 0
        assert (retirer.retired, retirer.failed) == (cycles - keep, 0)
        assert elapsed < 45.0
        retirer.close()


def test_a_blocked_unload_costs_only_its_timeout() -> None:
    trainer = Trainer()
    with ConformanceServer(TINY, **SERVER) as srv:
        emitter = emitter_for(srv)
        versions = AdapterVersions("policy", 2)
        retirer = Retirer(versions, emitter.retire_adapter, timeout_s=0.3)
        driver = Driver(emitter, versions, retirer)
        driver.sync(trainer, 1)
        # A rollout still holds v1: it expires, but the retirer never sends its unload.
        with versions.lease() as held:
            driver.sync(trainer, 2)
            driver.sync(trainer, 3)
            assert retirer.wait_idle(5.0) and retirer.failed == 1
            assert calls(srv, "/unload_lora_adapter") == [] and held.name in srv.engine.registry
        # The engine holds v2 (a leaked request counter): the unload blocks there, we give up in time.
        with srv.engine.hold("policy-v2"):
            t0 = time.monotonic()
            assert emitter.retire_adapter("policy-v2", timeout_s=0.5) is False
            assert 0.4 < time.monotonic() - t0 < 1.5
        deadline = time.monotonic() + 5
        while "policy-v2" in srv.engine.pending_unloads and time.monotonic() < deadline:
            time.sleep(0.01)
        driver.sync(trainer, 4)  # the engine's unload finished once the request let go
        assert "policy-v2" not in srv.engine.registry
        retirer.close()


@pytest.mark.parametrize("mode, expected", [
    ("none", ["begin", "update", "end", "load"]),
    ("retract", ["pause", "begin", "update", "end", "continue", "pause", "load", "continue"]),
    ("abort", ["pause", "begin", "update", "end", "continue", "pause", "load", "continue"]),
    ("in_place", ["pause", "begin", "update", "end", "continue", "flush", "pause", "load", "continue"]),
])
def test_pause_mode_wraps_the_loads(mode: str, expected: list[str]) -> None:
    with ConformanceServer(TINY, **SERVER) as srv:
        Driver(emitter_for(srv, pause_mode=mode), AdapterVersions("policy", 2)).sync(Trainer(), 1)
        short = {"/pause_generation": "pause", "/continue_generation": "continue", "/flush_cache": "flush",
                 "/begin_weight_update": "begin", "/update_weights_from_tensor": "update",
                 "/end_weight_update": "end", "/load_lora_adapter_from_tensors": "load"}
        assert [short[p] for p in calls(srv, *short)] == expected
        pauses = [b["mode"] for p, b in srv.engine.calls if p == "/pause_generation"]
        assert pauses == ([] if mode == "none" else [mode, mode])
        update = next(b for p, b in srv.engine.calls if p == "/update_weights_from_tensor")
        assert update["flush_cache"] is (mode != "in_place")


def test_cpu_payloads_carry_bytes_not_shared_memory_handles() -> None:
    # Odd sizes and mixed dtypes: every tensor must start where its dtype can be viewed.
    named = {"a": torch.randn(3, 5), "b": torch.randn(7).bfloat16(), "c": torch.randn(2)}
    bucket = pack_bucket(plan_buckets(named, 1 << 30)[0], named)
    payloads = serialize_for_ranks(bucket.payload(), 2, cuda=False)
    got = decode_tensors(payloads, 2, "flattened_bucket", remote=True)
    assert all(torch.equal(got[n], t) for n, t in named.items())
    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(bucket.payload())  # what a naive sender would do
    with pytest.raises(pickle.UnpicklingError, match="shared-memory handle"):
        decode_tensors([base64.b64encode(buf.getvalue()).decode()], 1, "flattened_bucket", remote=True)


def test_memory_release_frees_only_the_kv_cache() -> None:
    with ConformanceServer(TINY, enable_memory_saver=True, **SERVER) as srv:
        emitter = emitter_for(srv)
        emitter.release_kv_cache()
        emitter.resume_kv_cache()
        assert srv.engine.released == [["kv_cache"], ["kv_cache"]]


def test_nothing_reaches_a_host_the_config_did_not_name(monkeypatch: pytest.MonkeyPatch) -> None:
    elsewhere = socket.create_server(("127.0.0.1", 0))
    elsewhere.settimeout(0.5)
    other = f"http://127.0.0.1:{elsewhere.getsockname()[1]}"
    for var in ("HTTP_PROXY", "http_proxy", "ALL_PROXY"):
        monkeypatch.setenv(var, other)

    class Redirect(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(307)
            self.send_header("Location", other + "/server_info")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    with serving(Redirect) as url:
        client = SGLangClient(url, api_key="sekret", retries=0)
        with pytest.raises(SGLangError, match="redirect"):
            client.server_info()
        with pytest.raises(socket.timeout):
            elsewhere.accept()  # neither the proxy variables nor the redirect sent anything there
    elsewhere.close()
    with pytest.raises(ValueError, match="scheme://host:port"):
        SGLangClient("http://127.0.0.1:30000/v1")


@pytest.mark.parametrize("path, body, error", [
    ("/generate", {"input_ids": [1], "sampling_params": {"max_tokens": 2}}, "unknown field `max_tokens`"),
    ("/pause_generation", {"mode": "later"}, "field `mode` has the wrong type"),
    ("/update_weights_from_tensor", {"serialized_named_tensors": ["not base64!"]},
     "field `serialized_named_tensors` has the wrong type"),
])
def test_conformance_server_refuses_what_sglang_would_not_apply(path: str, body: dict, error: str) -> None:
    with ConformanceServer(TINY) as srv:
        req = urllib.request.Request(srv.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as answer:
            urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req)
        out = json.load(answer.value)  # /generate answers api/v1's {"error": text}, the others pydantic's shape
        assert answer.value.code == 400 and error in out.get("error", out.get("message"))


def test_the_base_streams_from_a_generator_bucket_by_bucket() -> None:
    trainer = Trainer()
    with ConformanceServer(TINY, **SERVER) as srv:
        emitter = emitter_for(srv)
        emitter._bucket_bytes = 16 * 1024  # a dozen buckets for the tiny model
        posted_when_made: list[int] = []

        def gathered():  # each step of a real one runs a collective
            for name, t in trainer.base.items():
                posted_when_made.append(len(calls(srv, "/update_weights_from_tensor")))
                yield name, t.clone()

        ack = emitter.send_base(gathered(), version=1)
        n_buckets = len(plan_buckets(trainer.base, 16 * 1024))
        updates = [body for path, body in srv.engine.calls if path == "/update_weights_from_tensor"]
        assert len(updates) == n_buckets > 3
        # When the last tensor is made, every bucket but the one it opens or fills has gone out.
        assert posted_when_made[-1] >= n_buckets - 2, "the generator was drained before the buckets went out"
        assert [u.get("weight_version") is not None for u in updates] == [False] * (n_buckets - 1) + [True]
        nbytes = sum(t.numel() * t.element_size() for t in trainer.base.values())
        assert (ack.version, ack.num_tensors, ack.nbytes) == (1, len(trainer.base), nbytes)
        for name, want in trainer.base.items():
            assert torch.equal(srv.engine.params[name].detach(), want), name


def test_an_empty_base_is_refused_and_changes_nothing() -> None:
    with ConformanceServer(TINY, **SERVER) as srv:
        emitter = emitter_for(srv)
        before = emitter.engine_incarnation()
        with pytest.raises(TransferError, match="got no tensors"):
            emitter.send_base(iter(()), version=1)
        assert calls(srv, "/update_weights_from_tensor") == [] and emitter.engine_incarnation() == before
