"""Agent tasks without an engine: hand-built episode records into samples (mask, segments, seq_len), the
GRPO loss over exactly their mask-1 tokens and its staleness weights (hand-derived numbers, the logit-table
model of test_grpo_objective.py), and a step's episode groups against a scripted agent and engine routes;
on a local server that never answers (a wedged engine), the rollout client's `interrupt` ends episodes."""

from __future__ import annotations

import math
import threading
import time
import types
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TypeVar

import httpx
import openai
import pytest
import torch

from http_helpers import serving
from test_grpo_objective import VOCAB, LogitTable

from titan_lora.clients.http import HTTPStatusError
from titan_lora.clients.openai_rollout import OpenAIRolloutClient
from titan_lora.config import GRPO
from titan_lora.rl.agent_objective import AgentObjective, check_agent_config
from titan_lora.rl.agent_task import is_agent_task
from titan_lora.rl.calculator_agent import CalculatorAgentTask, calculator_agent_task, multiplication_problems
from titan_lora.rl import episode_rollouts
from titan_lora.rl.episode_rollouts import run_episode_groups
from titan_lora.rl.episode_samples import EpisodeCounts, episode_samples
from titan_lora.rl.rollout import Sample
from titan_lora.rl.sample_source import sample_source
from titan_lora.rl.task import Problem, build_task
from titan_lora.sync.engine_access import EngineRollouts
from titan_lora.sync.versions import AdapterVersions, Lease
from titan_lora.titan.parallel import DataParallelInfo
from titan_lora.transfer import protocol
from titan_lora.transfer.episodes import EpisodeRecord, Segment
from titan_lora.transfer.errors import EngineHung, EngineUnreachable, TransferError

T = TypeVar("T")
STEP = 5  # the engine serves version STEP - 1 = 4; max_staleness 1 keeps versions >= 3
UNIFORM = -math.log(VOCAB)  # the zero table's log-prob of every token: the policy that drew them
TOKENIZER = types.SimpleNamespace(eos_token_id=0, pad_token_id=None)  # all AgentObjective reads of one


def segment(ids: list[int], mask: list[int], behaviour: float = UNIFORM, why_new: str | None = None) -> Segment:
    """A segment whose sampled tokens the engine gave log-prob `behaviour` (context tokens: 0.0)."""
    return Segment(tuple(ids), tuple(mask), tuple(behaviour if m else 0.0 for m in mask), why_new)


def record(*segments: Segment, version: int = 4, episode: str = "e") -> EpisodeRecord:
    return EpisodeRecord(episode, f"policy-v{version}", version, segments, ())


def samples_of(rec: EpisodeRecord, advantage: float, seq_len: int = 64,
               counts: EpisodeCounts | None = None) -> list[Sample]:
    return episode_samples(rec, 1.0 + advantage, advantage, seq_len, counts or EpisodeCounts())


def objective(**overrides) -> AgentObjective:
    settings = dict(enabled=True, task="calculator_agent", train_size=10, eval_size=2, max_staleness=1)
    cfg = GRPO(**(settings | overrides))
    return AgentObjective(cfg, build_task(cfg), TOKENIZER, None, DataParallelInfo(0, 1, None),
                          torch.device("cpu"), None, seq_len=64, loop=sample_source(cfg))


def loss_of(samples: list, model: LogitTable, **overrides) -> tuple[torch.Tensor, dict]:
    obj = objective(**overrides)
    obj._samples = lambda step: samples  # type: ignore[method-assign]
    return obj.loss(model, STEP)


def dlogp(grad: torch.Tensor, input_tok: int, label: int) -> float:
    """d loss / d logp at the position fed `input_tok` (test_grpo_objective.py's module docstring)."""
    other = next(v for v in range(VOCAB) if v != label)
    return float(grad[input_tok, label] - grad[input_tok, other])


# Episode A: prompt 1 2 3 | sampled 4 5 | tool 6 7 | sampled 8. Episode B: prompt 20 21 | sampled 22 |
# tool 23 24 | sampled 25. Every token is distinct, so each position has its own table row.
EPISODE_A = segment([1, 2, 3, 4, 5, 6, 7, 8], [0, 0, 0, 1, 1, 0, 0, 1])
EPISODE_B = segment([20, 21, 22, 23, 24, 25], [0, 0, 1, 0, 0, 1])


def test_a_segment_is_its_prompt_then_a_completion_carrying_the_mask_and_the_engine_logprobs() -> None:
    (s,) = samples_of(record(EPISODE_A, version=3), advantage=1.5)
    assert s.prompt_ids == [1, 2, 3] and s.completion_ids == [4, 5, 6, 7, 8]
    assert s.completion_mask == [1, 1, 0, 0, 1] and s.sampled_len == 3
    assert s.engine_logprobs == [UNIFORM, UNIFORM, 0.0, 0.0, UNIFORM]
    assert (s.version, s.reward, s.advantage) == (3, 2.5, 1.5)


def test_the_loss_covers_exactly_the_mask_1_tokens() -> None:
    samples = samples_of(record(EPISODE_A), 1.5) + samples_of(record(EPISODE_B), -0.5)
    model = LogitTable()
    loss, metrics = loss_of(samples, model)
    loss.backward()
    # On-policy, loss = sum(-adv x mask) / tokens over the 3 + 2 = 5 sampled tokens: (-1.5 x 3 + 0.5 x 2) / 5.
    assert float(loss.detach()) == pytest.approx(-0.7)
    # d loss / d logp = -adv / 5 where the label was sampled: -0.3 (A), +0.1 (B); 0 on prompt and tool labels.
    expected = {1: 0.0, 2: 0.0, 3: -0.3, 4: -0.3, 5: 0.0, 6: 0.0, 7: -0.3,
                20: 0.0, 21: 0.1, 22: 0.0, 23: 0.0, 24: 0.1}
    for ids in (EPISODE_A.ids, EPISODE_B.ids):
        for tok, label in zip(ids, ids[1:]):
            assert dlogp(model.table.grad, tok, label) == pytest.approx(expected[tok], abs=1e-6), tok
    # The engine-gap check reads the sampled tokens only: the tool tokens' 0.0 log-probs would be 4.16 off.
    assert metrics["rl/logprob_gap_max"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["rl/response_len"] == 2.5  # sampled tokens per sample


def test_an_episode_of_an_older_version_is_weighed_by_the_staleness_rule_and_a_too_old_one_dropped() -> None:
    # Episode A at version 3 (staleness 1): the engine gave its sampled tokens log(1/128), half the current
    # policy's 1/64, so their weight is pi_current / pi_behaviour = 2 (the cap). B at version 2 is dropped.
    stale = segment(list(EPISODE_A.ids), list(EPISODE_A.mask), behaviour=UNIFORM - math.log(2))
    samples = samples_of(record(stale, version=3), 1.5) + samples_of(record(EPISODE_B, version=2), -0.5)
    model = LogitTable()
    loss, metrics = loss_of(samples, model)
    loss.backward()
    assert metrics["rl/samples"] == 1 and metrics["rl/dropped_stale"] == 1 and metrics["rl/staleness_max"] == 1
    # d loss / d logp = -adv x weight / tokens = -1.5 x 2 / 3 on A's sampled labels; 0 on its tool labels.
    for tok, label in zip(EPISODE_A.ids, EPISODE_A.ids[1:]):
        want = -1.0 if tok in (3, 4, 7) else 0.0
        assert dlogp(model.table.grad, tok, label) == pytest.approx(want, abs=1e-6), tok
    assert torch.count_nonzero(model.table.grad[list(EPISODE_B.ids)]) == 0


def test_each_segment_of_a_multi_segment_episode_is_its_own_sample_and_context_only_ones_are_skipped() -> None:
    counts = EpisodeCounts()
    rec = record(EPISODE_A, segment([1, 2, 9, 10], [0, 0, 0, 1], why_new="differs at 2"),
                 segment([1, 2, 11], [0, 0, 0], why_new="differs at 2"))
    first, second = samples_of(rec, -1.0, counts=counts)
    assert second.prompt_ids == [1, 2, 9] and second.completion_ids == [10] and second.completion_mask == [1]
    assert first.advantage == second.advantage == -1.0 and first.version == second.version == 4
    assert (counts.episodes, counts.segments, counts.multi_segment, counts.empty) == (1, 2, 1, 0)


def test_a_segment_past_seq_len_is_cut_there_and_the_sampled_tokens_cut_off_counted() -> None:
    counts = EpisodeCounts()
    (s,) = samples_of(record(EPISODE_A), 1.0, seq_len=6, counts=counts)
    assert s.prompt_ids + s.completion_ids == [1, 2, 3, 4, 5, 6] and s.completion_mask == [1, 1, 0]
    assert counts.truncated_tokens == 1
    assert samples_of(record(EPISODE_A), 1.0, seq_len=3, counts=counts) == []  # no sampled token fits
    assert counts.truncated_tokens == 4 and counts.empty == 1
    assert samples_of(record(), 1.0, counts=counts) == [] and counts.empty == 2  # nothing was captured


def test_a_segment_that_starts_sampled_is_refused() -> None:
    with pytest.raises(ValueError, match="starts with a sampled token"):
        samples_of(record(segment([1, 2], [1, 1])), 1.0)


class Engine:
    """A rollout client, its episode routes over a dict, and a scripted agent that 'captures' into it."""

    client = None  # the `openai` client the agent gets (the scripted agent makes no request)

    def __init__(self) -> None:
        self.records: dict[str, EpisodeRecord] = {}

    def episode_routes(self) -> Engine:
        return self

    def wait_for(self, fn: Callable[[], T]) -> T:
        return fn()

    def post(self, path: str, body: dict) -> dict:
        eid = body["episode_id"]
        if path == protocol.path(protocol.DELETE_EPISODE):
            return {"deleted": self.records.pop(eid, None) is not None}
        if eid not in self.records:
            raise HTTPStatusError(f"no episode {eid}", 404)
        return self.records[eid].to_json()

    def run_episode(self, client: object, model: str, headers: dict[str, str], problem: Problem) -> float:
        eid = headers[protocol.EPISODE_HEADER]
        if problem.question != "silent":  # an agent that forgot the headers: nothing captured
            version = 9 if problem.question == "wrong model" else int(model.rsplit("-v", 1)[1])
            self.records[eid] = record(EPISODE_A, version=version, episode=eid)
        if problem.question == "boom":
            raise KeyError("the tool broke")
        if problem.question == "lost":
            raise openai.APIConnectionError(request=httpx.Request("POST", "http://engine/v1/chat/completions"))
        if problem.question == "core died":  # what vLLM's server answers while its engine core is gone
            request = httpx.Request("POST", "http://engine/v1/chat/completions")
            raise openai.InternalServerError("Error code: 500 - EngineCore encountered an issue.", body=None,
                                             response=httpx.Response(500, request=request))
        return float(problem.answer)


def test_a_step_runs_its_groups_fetches_and_deletes_every_record_and_scores_a_failing_agent_0() -> None:
    engine = Engine()
    problems = [Problem("a", 1), Problem("boom", 1), Problem("silent", 0), Problem("b", 0)]
    samples, counts = run_episode_groups(engine, engine, Lease("policy-v4", 4), problems, 2, 64)
    assert engine.records == {}, "every episode is deleted once fetched"
    # Rewards by episode: 1 1 | 0 0 (raised) | 0 0 (silent, nothing to train) | 0 0.
    assert [s.group for s in samples] == [0, 0, 1, 1, 3, 3]
    assert [s.reward_error for s in samples] == [False, False, True, True, False, False]
    assert all(s.version == 4 and s.advantage == 0.0 for s in samples)  # no group has a reward spread
    assert (counts.episodes, counts.empty, counts.agent_errors, counts.reward_sum) == (8, 2, 2, 2.0)
    assert counts.metrics()["rl/episode_reward_mean"] == 0.25


def test_an_agent_that_loses_the_engine_or_gets_its_5xx_raises_for_the_loops_recovery_and_one_off_its_model_is_refused() -> None:
    engine = Engine()
    with pytest.raises(EngineUnreachable, match="^an agent's request to the engine: Connection error"):
        run_episode_groups(engine, engine, Lease("policy-v4", 4), [Problem("lost", 1)], 1, 64)
    with pytest.raises(TransferError, match="^an agent's request to the engine failed with HTTP 500: .*EngineCore"):
        run_episode_groups(engine, engine, Lease("policy-v4", 4), [Problem("core died", 1)], 1, 64)
    with pytest.raises(RuntimeError, match="ran on 'policy-v9', not on 'policy-v4'"):
        run_episode_groups(engine, engine, Lease("policy-v4", 4), [Problem("wrong model", 1)], 1, 64)
    assert engine.records == {}


@pytest.mark.parametrize(("overrides", "why"), [
    (dict(rollouts=False), "rollouts = false leaves an agent task no episodes"),
    (dict(reward="exact_match"), "remove \\[grpo\\] reward"),
])
def test_settings_an_agent_task_does_not_run_under_are_refused(overrides: dict, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        check_agent_config(GRPO(enabled=True, task="calculator_agent", **overrides))


def test_the_async_loop_draws_one_problems_episodes_as_a_group_and_a_step_counts_the_groups_it_took() -> None:
    client = engine = Engine()
    cfg = GRPO(enabled=True, task="calculator_agent", train_size=10, eval_size=2, loop="async", prompts_per_step=2,
               group_size=3)
    obj = AgentObjective(cfg, build_task(GRPO(task="calculator_agent")),
                         TOKENIZER, EngineRollouts(client, None, lambda fn, what: fn()),
                         DataParallelInfo(0, 1, None), torch.device("cpu"), None, seq_len=64, loop=sample_source(cfg))
    obj.agent = engine
    groups = {i: obj._draw_group(i, Lease("policy-v4", 4)) for i in (2, 3)}  # step 2's two problems
    assert [len(g) for g in groups.values()] == [3, 3] and engine.records == {}
    for i, samples in groups.items():
        assert {(s.group, s.version) for s in samples} == {(i, 4)}
        assert samples[0].prompt_ids == list(EPISODE_A.ids[:3])
    obj.source = types.SimpleNamespace(taken=[3])  # a step that took group 3 alone
    obj.engine = EngineRollouts(client, None, lambda fn, what: groups[3])
    assert obj._step_samples(2) == groups[3]
    assert obj.counts.episodes == 3 and list(obj._group_counts) == [2], "the step counts its own groups"
    obj.source.taken, obj.engine = [2], EngineRollouts(client, None, lambda fn, what: [])
    with pytest.raises(RuntimeError, match="no episode of step 3 captured a sampled token"):
        obj._step_samples(3)


def test_the_sync_loop_runs_a_steps_groups_at_once_and_the_step_counts_all_their_episodes() -> None:
    client = engine = Engine()
    cfg = GRPO(enabled=True, task="calculator_agent", train_size=10, eval_size=2, prompts_per_step=2, group_size=3)
    versions = AdapterVersions("policy", keep_versions=3)
    versions.publish(1)
    obj = AgentObjective(cfg, build_task(cfg), TOKENIZER, EngineRollouts(client, versions, lambda fn, what: fn()),
                         DataParallelInfo(0, 1, None), torch.device("cpu"), None, seq_len=64, loop=sample_source(cfg))
    obj.agent = engine
    samples = obj._step_samples(2)
    assert [(s.group, s.version, s.trained_at) for s in samples] == [(2, 1, 2)] * 3 + [(3, 1, 2)] * 3
    assert obj.counts.episodes == 6 and obj._group_counts == {}, "the step's counts, taken once"


def test_an_engine_that_does_not_capture_episodes_is_refused_at_start() -> None:
    cfg = GRPO(enabled=True, task="calculator_agent", train_size=10, eval_size=2)
    router = types.SimpleNamespace(generate=None)  # a rollout client without episode routes (replicas' router)
    engine = EngineRollouts(router, None, lambda fn, what: fn())
    with pytest.raises(ValueError, match=r'needs an engine that captures episodes: \[engine\] kind = "vllm" with '
                                         "one replica \\(this rollout client is a SimpleNamespace\\)"):
        AgentObjective(cfg, build_task(cfg), TOKENIZER, engine,
                       DataParallelInfo(0, 1, None), torch.device("cpu"), None, seq_len=64, loop=sample_source(cfg))


def test_the_calculator_agent_task_multiplies_3_digit_numbers() -> None:
    task = build_task(GRPO(task="calculator_agent", max_new_tokens=24, temperature=0.7))
    assert is_agent_task(task) and not is_agent_task(build_task(GRPO()))
    assert task == CalculatorAgentTask(3, 24, 0.7)
    problems = task.problems(50, seed=1)
    assert problems == multiplication_problems(50, 1)
    for p in problems:
        a, b = (int(x) for x in p.question.removeprefix("What is ").rstrip("?").split(" * "))
        assert 100 <= a <= 999 and 100 <= b <= 999 and p.answer == a * b
    with pytest.raises(ValueError, match="digits = 12 must be 1 to 9"):
        calculator_agent_task(GRPO(), digits=12)


class Wedged(ThreadingHTTPServer):
    """An engine whose API server takes every request and never answers (a wedged engine core)."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Swallow)
        self.paths: list[str] = []
        self.unwedge = threading.Event()


class _Swallow(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.server.paths.append(self.path)
        self.server.unwedge.wait(30)  # then the connection closes unanswered

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def wedged() -> Iterator[Wedged]:
    srv = Wedged()
    with serving(srv, srv.unwedge.set):
        yield srv


class OneTurnAgent:
    """An agent whose episode is one chat turn through the client it is given (`turns`), or none."""

    def __init__(self, turns: bool) -> None:
        self.turns = turns

    def run_episode(self, client: object, model: str, headers: dict[str, str], problem: Problem) -> float:
        if self.turns:
            client.chat.completions.create(model=model, max_tokens=4, extra_headers=headers,
                                           messages=[{"role": "user", "content": problem.question}])
        return 1.0


@pytest.mark.parametrize(("turns", "path"), [(True, "/v1/chat/completions"),
                                             (False, protocol.path(protocol.EPISODE))],
                         ids=["agent turn", "record fetch"])
def test_an_episode_on_a_wedged_engine_ends_at_the_interrupt_not_at_the_rollout_timeout(
        wedged: Wedged, turns: bool, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # What the watchdog's on_wedge does for an attached engine: the rollout client's interrupt. The agent's
    # `openai` client and the episode routes wait on the same engine, so the interrupt must end them too.
    # Two episodes run at once and a third is queued: it must not begin after the interrupt.
    monkeypatch.setattr(episode_rollouts, "MAX_EPISODES_AT_ONCE", 2)
    client = OpenAIRolloutClient(f"http://127.0.0.1:{wedged.server_address[1]}", timeout_s=30.0)
    cfg = GRPO(enabled=True, task="calculator_agent", train_size=10, eval_size=2, loop="async", prompts_per_step=1,
               group_size=3)
    obj = AgentObjective(cfg, build_task(GRPO(task="calculator_agent")),
                         TOKENIZER, EngineRollouts(client, None, lambda fn, what: fn()),
                         DataParallelInfo(0, 1, None), torch.device("cpu"), None, seq_len=64, loop=sample_source(cfg))
    obj.agent = OneTurnAgent(turns)
    raised: list[BaseException] = []

    def draw() -> None:
        try:
            obj._draw_group(0, Lease("policy-v4", 4))
        except BaseException as err:  # noqa: BLE001 (checked below)
            raised.append(err)

    group = threading.Thread(target=draw)
    group.start()
    deadline = time.monotonic() + 20
    while len(wedged.paths) < 2 and time.monotonic() < deadline:  # both episodes wait on the engine
        time.sleep(0.01)
    time.sleep(0.1)
    assert wedged.paths == [path, path]
    started = time.monotonic()
    client.interrupt("the engine core did not answer LIVE")
    group.join(6)
    assert not group.is_alive() and time.monotonic() - started < 2.0, "ended at the interrupt, not at 30 s"
    assert len(raised) == 1 and isinstance(raised[0], EngineHung)
    assert "abandoned: the engine core did not answer LIVE" in str(raised[0])
    time.sleep(0.5)  # what the ended episodes, or the one queued, would send next
    assert wedged.paths == [path, path], "no delete sent to the wedged engine, no episode begun after"
