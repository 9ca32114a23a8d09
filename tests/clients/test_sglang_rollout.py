"""SGLang rollouts (the sglang kind's RolloutClient over /generate) against the conformance server, whose
answers come from its PEFT reference model; the trainer side is test_sglang's Trainer."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from scripted_sglang import Answering, serving
from sglang_conformance import ConformanceServer
from sglang_generate import contract_error
from sglang_schemas import RefusedError
from test_sglang import PROMPT, SERVER, TINY, Driver, Trainer, calls, emitter_for, policy_versions

from titan_lora.clients.base import Endpoint
from titan_lora.clients.kinds import engine_kind
from titan_lora.clients.rollout import RequestRefused
from titan_lora.clients.sglang_api import SGLangAuthError, SGLangClient, SGLangError, SGLangTimeout
from titan_lora.clients.sglang_rollout import SGLangRolloutClient
from titan_lora.config import WeightSync
from titan_lora.rl.grpo import group_advantages
from titan_lora.rl.rollout import greedy_accuracy, sample_groups
from titan_lora.rl.task import Problem
from titan_lora.sync.versions import AdapterVersions

OTHER = [9, 8, 77, 1, 30]


def rollouts_for(srv: ConformanceServer, api_key: str = "", **cfg) -> SGLangRolloutClient:
    """The sglang kind's rollout client, built the way the composition root builds it."""
    ws = WeightSync(**{"enabled": True, "timeout_s": 10.0, "retries": 1, "rollout_timeout_s": 30.0, **cfg})
    return engine_kind("sglang").rollouts(Endpoint(srv.url, api_key), ws)  # type: ignore[misc]


@torch.no_grad()
def greedy_ids(trainer: Trainer, prompt: list[int], n: int) -> list[int]:
    """The trainer's own greedy continuation (argmax of the PEFT model), ending at EOS as SGLang does."""
    ids = list(prompt)
    while len(ids) < len(prompt) + n and ids[-1] != TINY.eos_token_id:
        ids.append(int(trainer.model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def completion_logprobs(trainer: Trainer, prompt: list[int], completion: list[int], adapter: bool = True):
    """The trainer's log-prob of each completion token."""
    return trainer.token_logprobs(prompt + completion, adapter)[len(prompt) - 1:]


def gap(logprobs: list[float], trainer: Trainer, prompt: list[int], completion: list[int],
        adapter: bool = True) -> float:
    """max |served - trainer| over the completion's log-probs."""
    return (torch.tensor(logprobs) - completion_logprobs(trainer, prompt, completion, adapter)).abs().max().item()


def test_greedy_generate_is_the_references_continuation_with_its_logprobs() -> None:
    trainer = Trainer()
    with ConformanceServer(TINY, api_key="user", admin_api_key="admin", **SERVER) as srv:
        Driver(emitter_for(srv, api_key="user", admin_api_key="admin"), policy_versions()).sync(trainer, 1)
        rollouts = rollouts_for(srv, api_key="user")
        out = rollouts.generate([PROMPT, OTHER], "policy-v1", 6, 0.0, None, [])
        [(path, body)] = [c for c in srv.engine.calls if c[0] == "/generate"]  # one batched request
        assert body["input_ids"] == [PROMPT, OTHER] and body["lora_path"] == "policy-v1"
        assert contract_error(body) is None and srv.engine.ignored == []
        for prompt, c in zip((PROMPT, OTHER), out):
            assert c.token_ids == greedy_ids(trainer, prompt, 6)
            assert gap(c.logprobs, trainer, prompt, c.token_ids) <= 1e-3
            assert gap(c.logprobs, trainer, prompt, c.token_ids, adapter=False) > 0.05  # the test can fail


def test_score_is_the_references_logprobs_under_each_versioned_name() -> None:
    trainer = Trainer()
    with ConformanceServer(TINY, **SERVER) as srv:
        driver, rollouts = Driver(emitter_for(srv), policy_versions()), rollouts_for(srv)
        seqs = [PROMPT + [3, 3, 11], OTHER]
        driver.sync(trainer, 1)
        v1 = [trainer.token_logprobs(s) for s in seqs]
        driver.sync(trainer, 2)
        v2 = [trainer.token_logprobs(s) for s in seqs]
        base = [trainer.token_logprobs(s, False) for s in seqs]
        for name, want in (("policy-v1", v1), ("policy-v2", v2), (None, base)):
            got = rollouts.score(seqs, name)
            assert [len(g) for g in got] == [len(s) - 1 for s in seqs]
            assert max((torch.tensor(g) - w).abs().max().item() for g, w in zip(got, want)) <= 1e-3, name
        assert (v1[0] - v2[0]).abs().max() > 0.05  # the two names serve different adapters
        params = [b["sampling_params"] for p, b in srv.engine.calls if p == "/generate"]
        assert params == [{"max_new_tokens": 0}] * 3  # prefill only


def test_stop_tokens_end_the_completion_and_stay_in_its_ids() -> None:
    trainer = Trainer()
    decode = lambda ids: " ".join(map(str, ids))  # noqa: E731
    with ConformanceServer(TINY, detokenize=decode, enable_deterministic_inference=True, **SERVER) as srv:
        Driver(emitter_for(srv), policy_versions()).sync(trainer, 1)
        rollouts = rollouts_for(srv)
        [free] = rollouts.generate([PROMPT], "policy-v1", 8, 1.0, 5, [])  # seeded: the same draws again
        k = next(i for i in range(1, len(free.token_ids)) if free.token_ids[i] not in free.token_ids[:i])
        [stopped] = rollouts.generate([PROMPT], "policy-v1", 8, 1.0, 5, [free.token_ids[k]])
        assert stopped.token_ids == free.token_ids[:k + 1] and stopped.logprobs == free.logprobs[:k + 1]
        assert stopped.text == decode(free.token_ids[:k])  # SGLang's text drops the matched token


def test_seeded_sampling_repeats_on_a_deterministic_server_and_logprobs_are_the_models() -> None:
    trainer = Trainer()
    with ConformanceServer(TINY, enable_deterministic_inference=True, **SERVER) as srv:
        Driver(emitter_for(srv), policy_versions()).sync(trainer, 1)
        rollouts = rollouts_for(srv)
        prompts = [PROMPT, PROMPT, OTHER]
        first = rollouts.generate(prompts, "policy-v1", 6, 1.0, 7, [])
        assert [c.token_ids for c in rollouts.generate(prompts, "policy-v1", 6, 1.0, 7, [])] == \
            [c.token_ids for c in first]
        assert first[0].token_ids != first[1].token_ids  # prompt i is seeded with seed + i
        for prompt, c in zip(prompts, first):
            assert gap(c.logprobs, trainer, prompt, c.token_ids) <= 1e-3
        # At T != 1 SGLang returns log softmax(logits / T); the client scores the completions again.
        hot = rollouts.generate(prompts, "policy-v1", 6, 0.6, 7, [])
        for prompt, c in zip(prompts, hot):
            assert gap(c.logprobs, trainer, prompt, c.token_ids) <= 1e-3
        scaled = SGLangClient(srv.url).generate(PROMPT, "policy-v1", {"max_new_tokens": 6, "temperature": 0.6,
                                                                       "sampling_seed": 7})
        assert scaled.output_ids == hot[0].token_ids
        assert max(abs(a - b) for a, b in zip(scaled.output_logprobs, hot[0].logprobs)) > 0.05  # it mattered


def test_a_seed_the_server_ignores_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    trainer = Trainer()
    with ConformanceServer(TINY, **SERVER) as srv:
        Driver(emitter_for(srv), policy_versions()).sync(trainer, 1)
        rollouts = rollouts_for(srv)
        with caplog.at_level(logging.WARNING):
            for _ in range(2):
                rollouts.generate([PROMPT], "policy-v1", 2, 1.0, 3, [])
        assert [r.message for r in caplog.records].count(
            f"SGLang at {srv.url} runs without --enable-deterministic-inference, so it ignores sampling_seed: "
            "seeded rollouts will not repeat") == 1


def test_a_retired_or_unknown_name_fails_naming_the_adapter() -> None:
    with ConformanceServer(TINY, reload_stall_s=0.2, **SERVER) as srv:
        emitter = emitter_for(srv)
        Driver(emitter, policy_versions()).sync(Trainer(), 1)
        assert emitter.retire_adapter("policy-v1", 5.0)
        rollouts = rollouts_for(srv)
        for name in ("policy-v1", "policy-v9"):  # retired (SGLang tries to reload it); never loaded
            with pytest.raises(SGLangError, match=f"does not serve adapter '{name}': it was retired or never"):
                rollouts.generate([PROMPT], name, 2, 0.0, None, [])
            with pytest.raises(SGLangError, match=f"does not serve adapter '{name}'"):
                rollouts.score([PROMPT], name)
    with ConformanceServer(TINY, reload_stall_s=30.0, **SERVER) as srv:
        emitter = emitter_for(srv)
        Driver(emitter, policy_versions()).sync(Trainer(), 1)
        assert emitter.retire_adapter("policy-v1", 5.0)
        with pytest.raises(SGLangTimeout, match=r"rollout_timeout_s = 0\.5s"):  # a reload that stalls
            rollouts_for(srv, rollout_timeout_s=0.5).generate([PROMPT], "policy-v1", 2, 0.0, None, [])


def test_the_api_key_is_the_servers_api_key() -> None:
    with ConformanceServer(TINY, api_key="user", admin_api_key="admin", **SERVER) as srv:
        with pytest.raises(SGLangAuthError, match=r"401.*set \[engine\] api_key"):
            rollouts_for(srv, api_key="admin").score([PROMPT], None)
        assert len(rollouts_for(srv, api_key="user").score([PROMPT], None)[0]) == len(PROMPT) - 1


class _ShortBatch(Answering):
    """An SGLang that answers a batch with one completion too few."""

    def answer(self, body: bytes) -> object:
        meta = {"id": "x", "finish_reason": {"type": "length", "length": 1},
                "output_token_logprobs": [[-0.1, 3, None]], "input_token_logprobs": []}
        one = {"text": "", "output_ids": [3], "meta_info": meta}
        return [one] * (len(json.loads(body)["input_ids"]) - 1)


def test_a_batch_answered_short_is_an_error() -> None:
    with serving(_ShortBatch) as url:
        rollouts = SGLangRolloutClient(SGLangClient(url, retries=0), timeout_s=5.0)
        with pytest.raises(SGLangError, match="answered 1 completions for a batch of 2"):
            rollouts.generate([PROMPT, OTHER], None, 1, 0.0, None, [])


def test_grpo_sample_groups_and_greedy_eval_run_over_sglang() -> None:
    trainer = Trainer()
    decode = lambda ids: " ".join(map(str, ids))  # noqa: E731

    def reward(text: str, problem: Problem) -> float:  # the share of even tokens: varies within a group
        tokens = text.split()
        return sum(int(t) % 2 == 0 for t in tokens) / max(len(tokens), 1)

    with ConformanceServer(TINY, detokenize=decode, enable_deterministic_inference=True, **SERVER) as srv:
        versions = AdapterVersions("policy", keep_versions=2)
        Driver(emitter_for(srv), versions).sync(trainer, 1)
        rollouts = rollouts_for(srv)
        problems = [Problem("a", 0), Problem("b", 1)]
        samples = sample_groups(rollouts, versions, problems, [PROMPT, OTHER], group_size=4, max_tokens=5,
                                temperature=1.0, seed=11, stop_token_ids=[], reward=reward)
        assert len(samples) == 8 and {s.version for s in samples} == {1}
        assert [s.prompt_ids for s in samples] == [PROMPT] * 4 + [OTHER] * 4
        rewards = torch.tensor([s.reward for s in samples])
        assert torch.equal(torch.tensor([s.advantage for s in samples]), group_advantages(rewards, 4))
        assert rewards.std() > 0 and len({tuple(s.completion_ids) for s in samples}) > 2
        for s in samples:
            shown = s.completion_ids[:-1] if s.completion_ids[-1] == TINY.eos_token_id else s.completion_ids
            assert 1 <= len(s.completion_ids) <= 5 and s.text == decode(shown)  # EOS leaves the text
            assert gap(s.engine_logprobs, trainer, s.prompt_ids, s.completion_ids) <= 1e-3
        assert not any(srv.engine.counters.values()) and calls(srv, "/generate") == ["/generate"]
        accuracy = greedy_accuracy(rollouts, versions.active.name, problems, [PROMPT, OTHER], 5, [], reward)
        want = [reward(decode(greedy_ids(trainer, p, 5)), pr) for p, pr in zip((PROMPT, OTHER), problems)]
        assert accuracy == pytest.approx(sum(want) / 2)


@pytest.mark.parametrize("body, status, error", [
    ({"input_ids": [1], "return_logprob": "yes"}, 400,
     {"error": 'invalid type: string "yes", expected a value or an array of values for BoolOrList'}),
    ({"input_ids": [[1, 2], "x"]}, 400, {"error": 'invalid type: string "x", expected a sequence'}),
    ({"input_ids": []}, 400, {"error": {"message": "input_ids cannot be empty."}}),
    ({"input_ids": [1], "sampling_params": {"temperature": -1}}, 400,
     {"error": {"message": "temperature must be a non-negative finite number, got -1."}}),
    ({"text": None, "input_ids": None}, 400,
     {"error": {"message": "Either text, input_ids or input_embeds should be provided."}}),
])
def test_the_conformance_generate_refuses_bodies_as_0_5_23_does(body: dict, status: int, error: dict) -> None:
    """api/v1's contract answers {"error": text}; a ValueError of the tokenizer manager {"error": {"message"}}."""
    with ConformanceServer(TINY, **SERVER) as srv:
        try:
            answered = srv.route("POST", "/generate", {}, body, None)
        except RefusedError as err:  # how the handler answers it
            answered = (err.status, err.body)
        assert answered == (status, error)


def test_the_conformance_generate_answers_a_batch_as_a_list_and_ignores_unknown_fields() -> None:
    with ConformanceServer(TINY, **SERVER) as srv:
        status, out = srv.route("POST", "/generate", {}, {"input_ids": [PROMPT, OTHER], "rid": "r",
                                "return_logprob": True, "sampling_params": {"max_new_tokens": 2},
                                "lora_pth": "x"}, None)
        assert status == 200 and [o["meta_info"]["id"] for o in out] == ["r_0", "r_1"]
        assert all(len(o["meta_info"]["output_token_logprobs"]) == len(o["output_ids"]) for o in out)
        assert srv.engine.ignored == ["/generate:lora_pth"]


class _TooLong(Answering):
    """An SGLang that refuses every prompt as over its context length (0.5.23's status and words)."""

    status = 400

    def answer(self, body: bytes) -> object:
        return {"error": {"message": "The input (5 tokens) is longer than the model's context length "
                                     "(4 tokens)."}}


def test_a_prompt_sglang_refuses_is_the_requests_error_and_one_it_does_not_serve_the_replicas() -> None:
    with serving(_TooLong) as url:
        rollouts = SGLangRolloutClient(SGLangClient(url, retries=0), timeout_s=5.0)
        with pytest.raises(RequestRefused, match=r"failed \(400\).*longer than the model's context length"):
            rollouts.generate([PROMPT], None, 1, 0.0, None, [])
    with ConformanceServer(TINY, **SERVER) as srv:  # an adapter it lacks (400 too): the replica's state
        with pytest.raises(SGLangError, match="does not serve adapter 'policy-v9'") as raised:
            rollouts_for(srv).generate([PROMPT], "policy-v9", 2, 0.0, None, [])
        assert not isinstance(raised.value, RequestRefused)
