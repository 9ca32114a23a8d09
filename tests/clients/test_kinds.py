"""The engine kinds: lazy built-ins, their capabilities and launchers, plug-ins by registration or by
`module:KIND` (the registry's own rules: tests/test_registry.py)."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch

from titan_lora.clients import kinds
from titan_lora.clients.base import Endpoint
from titan_lora.clients.kinds import EngineKind, LaunchPlan, LaunchRequest, engine_kind, register_engine_kind
from titan_lora.config import Engine, WeightSync
from titan_lora.registry import Registry


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> dict:
    """A fresh copy of the kind registry for one test; returns its name -> entry table."""
    fresh = Registry(kinds._KINDS.key, kinds._KINDS.noun, kinds.BUILT_IN_KINDS, EngineKind)
    monkeypatch.setattr(kinds, "_KINDS", fresh)
    return fresh._entries


def _echo_emitter(ws: WeightSync, engine: Engine, endpoint: Endpoint) -> tuple:
    return ("emitter", ws.bucket_mb, engine.pause_mode, endpoint.url)


def test_a_built_in_kind_is_imported_only_when_asked(registry: dict) -> None:
    assert registry["vllm-disk"] == "titan_lora.clients.disk:VLLM_DISK"
    kind = engine_kind("vllm-disk")
    from titan_lora.clients.disk import VLLM_DISK, DiskEmitter

    assert kind is VLLM_DISK and registry["vllm-disk"] is VLLM_DISK
    emitter = kind.emitter(WeightSync(bucket_mb=3), Engine(disk_dir="/tmp"), Endpoint("http://e:1", "k"))
    assert isinstance(emitter, DiskEmitter) and (emitter.client.base_url, emitter.client.api_key) == ("http://e:1", "k")
    emitter.close()


def test_the_built_in_kinds_declare_what_validation_asks() -> None:
    caps = {name: (k.rollouts is not None, k.launch is not None, k.shm_buckets, k.max_lora_rank is not None,
                   k.check_targets is not None)
            for name in kinds.registered_engine_kinds() for k in [engine_kind(name)]}
    # (rollouts, titan_lora can start it, shm buckets on CPU, vLLM's rank limit, a target-set rule)
    assert caps == {"vllm": (True, True, True, True, False), "vllm-disk": (True, True, True, True, False),
                    "vllm-openai": (True, True, True, True, False),
                    "receiver": (False, True, True, False, False), "sglang": (True, False, False, False, True)}


def test_the_launchers_plan_the_engine_processes() -> None:
    req = LaunchRequest(Engine(max_model_len=640, kv_cache_gib=5), 3, "/hf", torch.device("cuda", 1), 12)
    assert engine_kind("vllm").launch(req) == engine_kind("vllm-openai").launch(req)
    assert engine_kind("vllm-disk").launch(req) == engine_kind("vllm").launch(req), "the baseline runs on the same engine"
    assert engine_kind("receiver").launch(req) == LaunchPlan("titan_lora.engines.receiver",
                                                             ["--device", "cuda:1", "--max-loras", "8"])
    assert engine_kind("vllm-openai").launch(req) == LaunchPlan("titan_lora.engines.vllm_openai", [
        "/hf", "--host", "127.0.0.1", "--dtype", "float32", "--enforce-eager", "--seed", "0",
        "--max-lora-rank", "16", "--max-loras", "4", "--max-cpu-loras", "5", "--max-model-len", "640",
        "--max-num-seqs", "64", "--max-num-batched-tokens", "4096", "--kv-cache-memory-bytes", str(5 * 2**30), "--disable-uvicorn-access-log"],
        standby=True)  # a GPU engine: a restart runs in the standby interpreter
    three = dataclasses.replace(req, adapters=3)  # three [[adapters]]: keep_versions + 1 = 4 slots each
    assert engine_kind("vllm").launch(three).args[10:14] == ["--max-loras", "12", "--max-cpu-loras", "13"]
    assert engine_kind("receiver").launch(three).args[-2:] == ["--max-loras", "12"]
    push = dataclasses.replace(req, base_digests=False)  # [weight_sync] base = "push": nobody asks for them
    assert engine_kind("vllm").launch(push).args == [*engine_kind("vllm").launch(req).args,
                                                      "--titan-skip-base-digests"]


def test_a_standby_waits_beside_a_gpu_engine_by_default_and_as_the_config_says() -> None:
    gpu = LaunchRequest(Engine(), 2, "/hf", torch.device("cuda", 0), 8)
    cpu = dataclasses.replace(gpu, device=torch.device("cpu"))
    plans = {(device.type, mode): engine_kind("vllm").launch(dataclasses.replace(req, engine=Engine(standby=mode)))
             for req, device in ((gpu, gpu.device), (cpu, cpu.device)) for mode in ("auto", "on", "off")}
    assert {key: plan.standby for key, plan in plans.items()} == {
        ("cuda", "auto"): True, ("cuda", "on"): True, ("cuda", "off"): False,
        ("cpu", "auto"): False, ("cpu", "on"): True, ("cpu", "off"): False}
    assert not engine_kind("receiver").launch(gpu).standby, "the receiver's import is cheap: no standby"


def test_a_cpu_engine_gets_the_cores_not_a_ranks_one_thread(monkeypatch) -> None:
    """torchrun sets OMP_NUM_THREADS=1 on every rank and the engine would inherit it: a CPU engine's plan sets
    its threads to `[engine] cpu_threads`, or the cores this process may use shared among the replicas; a GPU
    engine's plan sets nothing."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5})
    cpu = LaunchRequest(Engine(), 2, "/hf", torch.device("cpu"), 8)
    assert engine_kind("vllm").launch(cpu).env == {"OMP_NUM_THREADS": "6"}
    assert engine_kind("vllm").launch(dataclasses.replace(cpu, engine=Engine(replicas=4))).env == {
        "OMP_NUM_THREADS": "1"}
    assert engine_kind("vllm").launch(dataclasses.replace(cpu, engine=Engine(cpu_threads=3))).env == {
        "OMP_NUM_THREADS": "3"}
    assert engine_kind("vllm").launch(dataclasses.replace(cpu, device=torch.device("cuda", 0))).env == {}

def test_a_registered_plug_in_is_selected_by_name(registry: dict) -> None:
    mine = register_engine_kind(EngineKind("echo", _echo_emitter))
    assert engine_kind("echo") is mine and "echo" in kinds.registered_engine_kinds()
    assert mine.emitter(WeightSync(bucket_mb=7), Engine(pause_mode="abort"), Endpoint("http://e:2")) == (
        "emitter", 7, "abort", "http://e:2")
    with pytest.raises(ValueError) as err:
        register_engine_kind(EngineKind("echo", _echo_emitter))
    assert str(err.value) == "engine kind 'echo' is already registered"


def test_a_plug_in_is_loaded_by_module_and_attribute(monkeypatch: pytest.MonkeyPatch, registry: dict) -> None:
    module = types.ModuleType("my_engines")
    module.ECHO = EngineKind("echo", _echo_emitter)
    module.NOT_A_KIND = object()
    monkeypatch.setitem(sys.modules, "my_engines", module)
    assert engine_kind("my_engines:ECHO") is module.ECHO
    with pytest.raises(ValueError) as err:
        engine_kind("my_engines:NOT_A_KIND")
    assert str(err.value) == "[engine] kind = 'my_engines:NOT_A_KIND': expected EngineKind, got object"
    with pytest.raises(ValueError, match=r"^\[engine\] kind = 'no_such_pkg:X': cannot load 'no_such_pkg:X' \(No module"):
        engine_kind("no_such_pkg:X")
    assert "my_engines:ECHO" not in registry, "a path is loaded, not registered"


def test_an_unknown_kind_names_the_known_ones() -> None:
    with pytest.raises(ValueError) as err:
        engine_kind("vlm")
    assert str(err.value) == ("[engine] kind = 'vlm' is not registered; known: receiver, sglang, vllm, "
                              "vllm-disk, vllm-openai (or `package.module:attribute` for a plug-in)")
