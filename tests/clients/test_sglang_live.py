"""The SGLang emitter against a live SGLang 0.5.23 server (opt-in: `pytest -m sglang`).

Set TITAN_LORA_SGLANG_URL (the server root) and TITAN_LORA_SGLANG_MODEL (a local HF directory holding
the server's --model-path, for the trainer-side reference); TITAN_LORA_SGLANG_API_KEY if the server was
started with --api-key; TITAN_LORA_SGLANG_TOLERANCE to loosen the log-prob bound (default 1e-3, which
needs a float32 server). docs/sglang.md gives the server command line.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch
from test_sglang import GREEDY, PROMPT, Driver, Trainer, assert_parity
from test_sglang_rollout import gap
from transformers import LlamaForCausalLM

from titan_lora.clients.base import Endpoint
from titan_lora.clients.kinds import engine_kind
from titan_lora.clients.sglang_api import SGLangAuthError, SGLangClient, SGLangError
from titan_lora.config import Engine, WeightSync
from titan_lora.sync.retire import Retirer
from titan_lora.sync.versions import AdapterVersions
from titan_lora.transfer.errors import EngineWeightsLost

pytestmark = pytest.mark.sglang
URL = os.environ.get("TITAN_LORA_SGLANG_URL", "")
MODEL = os.environ.get("TITAN_LORA_SGLANG_MODEL", "")
API_KEY = os.environ.get("TITAN_LORA_SGLANG_API_KEY", "")
TOLERANCE = float(os.environ.get("TITAN_LORA_SGLANG_TOLERANCE", "1e-3"))
if not (URL and MODEL):
    pytest.skip("set TITAN_LORA_SGLANG_URL and TITAN_LORA_SGLANG_MODEL to run the live SGLang tests",
                allow_module_level=True)


@pytest.fixture(scope="module")
def trainer() -> Trainer:
    """The trainer side: the server's own model in float32, with a rank-8 adapter."""
    return Trainer(r=8, base=LlamaForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval())


def live_rollouts():
    """The sglang kind's rollout client for the live server, as the composition root builds it."""
    ws = WeightSync(enabled=True, timeout_s=300.0, rollout_timeout_s=300.0)
    return engine_kind("sglang").rollouts(Endpoint(URL, API_KEY), ws)


def live_emitter(pause_mode: str = "none", **cfg):
    """The registered SGLang emitter for the live server."""
    ws = WeightSync(**{"enabled": True, "keep_versions": 2, "timeout_s": 300.0, **cfg})
    engine = Engine(kind="sglang", url=URL, api_key=API_KEY, pause_mode=pause_mode)
    return engine_kind("sglang").emitter(ws, engine, Endpoint(URL, API_KEY))


def test_limits_base_adapters_parity_and_incarnation(trainer: Trainer) -> None:
    emitter = live_emitter()
    limits = emitter.engine_limits()
    assert limits.max_lora_rank >= 8 and limits.max_loras >= 3
    with pytest.raises(EngineWeightsLost):  # this emitter has not sent its base yet
        emitter.send_adapter(trainer.step(1))
    versions = AdapterVersions("policy", keep_versions=2)
    driver = Driver(emitter, versions)
    for step in (1, 2):
        driver.sync(trainer, step)
        assert emitter.engine_incarnation() == driver.incarnation
        assert_parity(emitter.client, trainer, versions.active.name, TOLERANCE)


def test_retire_unloads_and_the_name_is_gone(trainer: Trainer) -> None:
    emitter = live_emitter()
    versions = AdapterVersions("policy", keep_versions=2)
    driver = Driver(emitter, versions)
    driver.sync(trainer, 10)
    driver.sync(trainer, 11)
    assert emitter.retire_adapter("policy-v10", timeout_s=60.0)
    with pytest.raises(SGLangError, match="'policy-v10' was retired"):  # the client knows what it unloaded
        emitter.client.generate(PROMPT, "policy-v10", {"max_new_tokens": 1})
    assert emitter.retire_adapter("policy-v10", timeout_s=60.0)  # already gone counts as done


@pytest.mark.parametrize("mode", ["retract", "in_place", "abort"])
def test_pause_modes_are_accepted(trainer: Trainer, mode: str) -> None:
    emitter = live_emitter(pause_mode=mode)
    driver = Driver(emitter, AdapterVersions("policy", keep_versions=2))
    driver.sync(trainer, 20)
    driver.sync(trainer, 21)
    for name in ("policy-v20", "policy-v21"):
        assert emitter.retire_adapter(name, timeout_s=60.0)


def test_syncs_with_rollouts_in_flight_keep_the_window(trainer: Trainer) -> None:
    emitter = live_emitter()
    versions = AdapterVersions("policy", keep_versions=2)
    retirer = Retirer(versions, emitter.retire_adapter, timeout_s=30.0)
    driver = Driver(emitter, versions, retirer)
    driver.sync(trainer, 100)
    stop, errors = threading.Event(), []

    def rollouts() -> None:
        while not stop.is_set():
            with versions.lease() as lease:
                try:
                    emitter.client.generate(PROMPT, lease.name, {"max_new_tokens": 16})
                except SGLangError as err:
                    errors.append(err)

    workers = [threading.Thread(target=rollouts, daemon=True) for _ in range(4)]
    for w in workers:
        w.start()
    for step in range(101, 131):
        driver.sync(trainer, step)
        assert len(versions.live) <= 3
        assert retirer.wait_idle(60.0)
    stop.set()
    for w in workers:
        w.join(60.0)
    assert not errors and retirer.failed == 0
    retirer.close()


def test_kv_cache_release_and_resume_keep_the_weights_and_the_adapter(trainer: Trainer) -> None:
    """0.5.23 releases only the KV cache (and flushes it); base and adapters must serve the same answers."""
    emitter = live_emitter()
    versions = AdapterVersions("policy", keep_versions=2)
    driver = Driver(emitter, versions)
    driver.sync(trainer, 40)
    before = emitter.client.generate(PROMPT, versions.active.name, GREEDY, logprob_start_len=0)
    incarnation = emitter.engine_incarnation()
    emitter.release_kv_cache()  # needs an idle server: nothing is in flight here
    emitter.resume_kv_cache()
    assert emitter.engine_incarnation() == incarnation, "releasing the KV cache must not touch the weights"
    after = emitter.client.generate(PROMPT, versions.active.name, GREEDY, logprob_start_len=0)
    assert after.output_ids == before.output_ids
    served = torch.tensor(after.input_logprobs[1:] + after.output_logprobs)
    first = torch.tensor(before.input_logprobs[1:] + before.output_logprobs)
    assert (served - first).abs().max() <= TOLERANCE
    assert_parity(emitter.client, trainer, versions.active.name, TOLERANCE)  # the adapter is still applied
    driver.sync(trainer, 41)  # and the next sync needs no new base
    assert emitter.engine_incarnation() == incarnation


@pytest.mark.skipif(not API_KEY, reason="the server has no --api-key")
def test_wrong_api_key_is_refused() -> None:
    with pytest.raises(SGLangAuthError, match="401"):
        SGLangClient(URL, api_key=API_KEY + "-wrong").server_info()


def test_rollouts_generate_and_score_match_the_trainer(trainer: Trainer) -> None:
    """The GRPO loop's client: batched greedy and sampled generate, score, stop tokens, a retired name."""
    emitter, rollouts = live_emitter(), live_rollouts()
    versions = AdapterVersions("policy", keep_versions=2)
    driver = Driver(emitter, versions)
    driver.sync(trainer, 50)
    name = versions.active.name
    prompts = [PROMPT, PROMPT[::-1]]
    for temperature, seed in ((0.0, None), (1.0, 3), (0.7, 3)):  # 0.7: the client re-scores at T != 1
        for prompt, c in zip(prompts, rollouts.generate(prompts, name, 8, temperature, seed, [])):
            assert 1 <= len(c.token_ids) <= 8 and len(c.logprobs) == len(c.token_ids)
            assert gap(c.logprobs, trainer, prompt, c.token_ids) <= TOLERANCE, (temperature, c)
    seqs = [PROMPT + [11, 12, 13], PROMPT[::-1]]
    for seq, got in zip(seqs, rollouts.score(seqs, name)):
        assert (torch.tensor(got) - trainer.token_logprobs(seq)).abs().max() <= TOLERANCE
    [free] = rollouts.generate([PROMPT], name, 8, 0.0, None, [])
    [stopped] = rollouts.generate([PROMPT], name, 8, 0.0, None, [free.token_ids[0]])
    assert stopped.token_ids == free.token_ids[:1]  # the matched stop token ends it and stays in the ids
    driver.sync(trainer, 51)
    driver.sync(trainer, 52)
    assert emitter.retire_adapter("policy-v50", timeout_s=60.0)
    with pytest.raises(SGLangError, match="does not serve adapter 'policy-v50'"):
        rollouts.generate([PROMPT], "policy-v50", 2, 0.0, None, [])
