"""The unmodified tinker SDK (0.38.0) against a live `titan-lora serve` on SmolLM2-135M: it trains, each client
gets its own results whoever else trains beside it, bad calls fail alone, keys are kept apart, and a saved
state survives a restart of the service, on 2 trainer ranks, to give the identical next step."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
import torch
from wait_helpers import waited
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

pytestmark = pytest.mark.slow

CONFIG = "train_configs/smollm2_service.toml"
NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
KEY, OTHER_KEY = "tml-local-dev", "tml-someone-else"
ADAM = types.AdamParams(learning_rate=2e-3, beta1=0.9, beta2=0.95, eps=1e-8)
ROOT = Path(__file__).resolve().parents[2]
MAX_QUEUED = 16
ABANDONING_CLIENT = """
import os, sys, tinker
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
client = tinker.ServiceClient(base_url=sys.argv[1], api_key=sys.argv[2]).create_lora_training_client(
    base_model=sys.argv[3], rank=4).result()
print(client.get_info().model_id, flush=True)
datum = types.Datum(model_input=types.ModelInput.from_ints(list(range(1, 400))),
                    loss_fn_inputs={"target_tokens": list(range(2, 401)), "weights": [1.0] * 399})
futures = [client.forward_backward([datum] * 2, "cross_entropy") for _ in range(3)]
print("submitted", flush=True)
futures[-1].result()
"""


class Service:
    """A `titan-lora serve` process on a free port."""

    def __init__(self, dump: Path, *overrides: str, nproc: int = 1) -> None:
        env = {**os.environ, "TITAN_LORA_API_KEYS": OTHER_KEY}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "titan_lora.cli", "serve", CONFIG, "--nproc", str(nproc), "--service.port", "0",
             "--job.dump_folder", str(dump), *overrides], cwd=ROOT, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        for line in self.proc.stdout:
            self.lines.append(line)
            found = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
            if found:
                self.url = found.group(1)
                break
        else:
            raise AssertionError("the service did not start:\n" + "".join(self.lines[-30:]))
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(60) is not None


@pytest.fixture(scope="module")
def dump(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("service")


@pytest.fixture(scope="module")
def service(dump: Path) -> Iterator[Service]:
    served = Service(dump, "--service.max_queued", str(MAX_QUEUED), "--service.session_timeout_s", "25")
    yield served
    served.stop()


def _batch(tokenizer, start: int, count: int = 4) -> list[types.Datum]:
    """SFT datums from the shipped arithmetic data: loss on the completion tokens only."""
    lines = (ROOT / "titan_lora/data/arith_sft.jsonl").read_text().splitlines()[start:start + count]
    data = []
    for row in map(json.loads, lines):
        prompt = tokenizer.encode(row["prompt"] + " ", add_special_tokens=False)
        tokens = prompt + tokenizer.encode(row["completion"], add_special_tokens=False) + [tokenizer.eos_token_id]
        weights = [0.0] * (len(prompt) - 1) + [1.0] * (len(tokens) - len(prompt))
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights}))
    return data


def _step(client, data) -> float:
    backward = client.forward_backward(data, "cross_entropy")
    client.optim_step(ADAM).result()
    return backward.result().metrics["loss:sum"]


def _logprobs(result) -> list[np.ndarray]:
    return [np.asarray(o["logprobs"].data) for o in result.loss_fn_outputs]


def test_the_sdk_trains_and_forward_agrees_with_forward_backward(service: Service) -> None:
    with tinker.ServiceClient(base_url=service.url, api_key=KEY) as sdk:
        _train_and_compare(sdk.create_lora_training_client(base_model=NAME, rank=8, seed=1))


def _train_and_compare(client) -> None:
    assert client.get_info().lora_rank == 8
    data = _batch(client.get_tokenizer(), 0)
    # 4 steps: measured 47.6 -> 13.1, 14.3, 4.6 (0.1 of the first; 0.006 after 8)
    losses = [_step(client, data) for _ in range(4)]
    assert losses[-1] < 0.5 * losses[0], losses
    seen = client.forward(data, "cross_entropy").result()
    trained = client.forward_backward(data, "cross_entropy").result()
    for ours, theirs in zip(_logprobs(seen), _logprobs(trained)):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)
    weights = [np.asarray(d.loss_fn_inputs["weights"].data) for d in data]
    assert seen.metrics["loss:sum"] == pytest.approx(-sum((w * lp).sum() for w, lp in zip(weights, _logprobs(seen))),
                                                     rel=1e-5)


def test_a_custom_loss_trains_exactly_as_the_built_in_loss_it_equals(service: Service) -> None:
    """forward_backward_custom (the SDK's client-side loss: a forward, then a cross_entropy backward weighted
    by -dC/dlogp) with C = cross_entropy's sum moves a client exactly as cross_entropy does."""
    def custom(data, logprobs):
        loss = sum(-(torch.as_tensor(d.loss_fn_inputs["weights"].data) * lp).sum() for d, lp in zip(data, logprobs))
        return loss, {}

    with tinker.ServiceClient(base_url=service.url, api_key=KEY) as sdk:
        built_in, client_side = (sdk.create_lora_training_client(base_model=NAME, rank=8, seed=4) for _ in range(2))
        data = _batch(built_in.get_tokenizer(), 20)
        expected = built_in.forward_backward(data, "cross_entropy").result().metrics["loss:sum"]
        assert client_side.forward_backward_custom(data, custom).result().metrics["loss:sum"] == pytest.approx(
            expected, rel=1e-6)
        for client in (built_in, client_side):
            client.optim_step(ADAM).result()
        after = [_logprobs(c.forward(data, "cross_entropy").result()) for c in (built_in, client_side)]
        for ours, theirs in zip(*after):
            np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-6)
        assert not np.allclose(after[0][0], _logprobs(sdk.create_lora_training_client(
            base_model=NAME, rank=8, seed=4).forward(data, "cross_entropy").result())[0])  # the step moved it


def test_two_clients_at_once_each_get_what_they_get_alone(service: Service) -> None:
    """Three clients live at once, then closed: their slots are freed (the later tests need them)."""
    with tinker.ServiceClient(base_url=service.url, api_key=KEY) as sdk:
        session = _two_at_once(service, sdk)
    assert waited(lambda: sum(f"{session}:train:" in line and "released" in line for line in service.lines) == 3,
                  10), [line for line in service.lines if session in line]


def _two_at_once(service: Service, sdk) -> str:
    alone = sdk.create_lora_training_client(base_model=NAME, rank=4, seed=7)
    tokenizer = alone.get_tokenizer()
    mine, theirs = _batch(tokenizer, 8), _batch(tokenizer, 20, 6)
    expected = [_step(alone, mine) for _ in range(3)]
    first, second = (sdk.create_lora_training_client(base_model=NAME, rank=4, seed=7),
                     sdk.create_lora_training_client(base_model=NAME, rank=16, seed=8))
    results: dict[str, list[float]] = {}
    threads = [threading.Thread(target=lambda c=c, d=d, k=k: results.__setitem__(k, [_step(c, d) for _ in range(3)]))
               for c, d, k in ((first, mine, "first"), (second, theirs, "second"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    np.testing.assert_allclose(results["first"], expected, rtol=1e-6)
    assert len(results["second"]) == 3
    mixed = [line for line in service.lines if "mixed step" in line]
    assert not mixed, mixed  # no step failed
    return alone.get_info().model_id.split(":")[0]


def test_a_bad_call_fails_alone_and_the_client_goes_on(service: Service) -> None:
    with tinker.ServiceClient(base_url=service.url, api_key=KEY) as sdk:
        _bad_calls(sdk.create_lora_training_client(base_model=NAME, rank=4, seed=2))


def _bad_calls(client) -> None:
    data = _batch(client.get_tokenizer(), 30, 2)
    bad = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 10**6]),
                      loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]})
    with pytest.raises(tinker.RequestFailedError, match="token id 1000000 outside the vocabulary"):
        client.forward_backward([bad], "cross_entropy").result()
    short = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0]})
    with pytest.raises(tinker.RequestFailedError, match=r"loss_fn_inputs\['weights'\] has shape \[1\]"):
        client.forward_backward([short], "cross_entropy").result()
    assert _step(client, data) > 0  # the next calls run


def test_a_key_sees_only_its_own_models(service: Service) -> None:
    with tinker.ServiceClient(base_url=service.url, api_key=KEY) as sdk:
        _kept_apart(service, sdk.create_lora_training_client(base_model=NAME, rank=4))


def _kept_apart(service: Service, mine) -> None:
    model_id = mine.get_info().model_id
    future = mine.forward_backward(_batch(mine.get_tokenizer(), 0, 1), "cross_entropy")
    future.result()
    with httpx.Client(base_url=f"{service.url}/api/v1", headers={"X-API-Key": OTHER_KEY}) as other:
        answer = other.post("/get_info", json={"model_id": model_id, "type": "get_info"})
        assert answer.status_code == 404 and "not one of this API key's models" in answer.json()["detail"]
        answer = other.post("/optim_step", json={"model_id": model_id, "seq_id": 99, "type": "optim_step",
                                                "adam_params": {"learning_rate": 1.0}})
        assert answer.status_code == 404
    with httpx.Client(base_url=f"{service.url}/api/v1", headers={"X-API-Key": "tml-not-a-key"}) as stranger:
        answer = stranger.post("/create_session", json={"tags": [], "sdk_version": "0.38.0", "type": "create_session"})
        assert answer.status_code == 401 and "unknown API key" in answer.json()["detail"]


def test_a_flood_is_refused_and_a_vanished_client_is_cleaned_up(service: Service) -> None:
    """A key over [service] max_queued waiting calls gets 429 (the SDK's back-off signal) and the other
    clients go on; a client killed mid-future leaves the service healthy, and its slot is freed once its
    session goes silent ([service] session_timeout_s)."""
    vanishing = subprocess.Popen([sys.executable, "-c", ABANDONING_CLIENT, service.url, OTHER_KEY, NAME],
                                 stdout=subprocess.PIPE, text=True)
    model_id = vanishing.stdout.readline().strip()
    assert vanishing.stdout.readline().strip() == "submitted"
    vanishing.kill()  # mid-future: its calls run or wait with nobody polling
    vanishing.wait()
    with tinker.ServiceClient(base_url=service.url, api_key=OTHER_KEY) as flooder:
        flooding = flooder.create_lora_training_client(base_model=NAME, rank=4).result()
        data = _batch(flooding.get_tokenizer(), 50, 2)
        model = flooding.get_info().model_id
        with httpx.Client(base_url=f"{service.url}/api/v1", headers={"X-API-Key": OTHER_KEY}) as raw:
            codes = [raw.post("/forward_backward", headers={"Content-Type": "application/x-protobuf"},
                              content=forward_backward_request_to_proto(types.ForwardBackwardRequest(
                                  forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
                                  model_id=model, seq_id=1000 + i)).SerializeToString()).status_code
                     for i in range(MAX_QUEUED + 4)]
        assert 200 in codes and codes[-4:] == [429] * 4, codes  # the vanished client's calls count too
        with tinker.ServiceClient(base_url=service.url, api_key=KEY) as sdk:  # another key is not held up
            assert _step(sdk.create_lora_training_client(base_model=NAME, rank=4).result(), data) > 0
    assert waited(lambda: any(f"{model_id} released" in line for line in service.lines), 60), model_id


def _prompt_and_answer(tokenizer) -> tuple[list[int], list[int]]:
    prompt = tokenizer.encode("What is 2 + 3? Answer with just the number. ", add_special_tokens=False)
    return prompt, tokenizer.encode("5", add_special_tokens=False) + [tokenizer.eos_token_id]


def test_a_sampler_serves_exactly_the_version_saved(service: Service) -> None:
    """save_weights_for_sampler puts the adapter into the live vLLM engine through the sync: the engine's
    log-probs of that version equal the trainer's (1e-3), move with training, and an older sampler keeps
    its own version, for as long as it samples (the versions no sampler uses are retired first)."""
    with tinker.ServiceClient(base_url=service.url, api_key=KEY) as sdk:
        client = sdk.create_lora_training_client(base_model=NAME, rank=8, seed=4).result()
        tokenizer = client.get_tokenizer()
        prompt, answer = _prompt_and_answer(tokenizer)
        tokens = prompt + answer
        datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
            "target_tokens": tokens[1:], "weights": [0.0] * (len(prompt) - 1) + [1.0] * len(answer)})
        before = client.save_weights_and_get_sampling_client()
        untrained = before.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
        for _ in range(5):
            client.forward_backward([datum], "cross_entropy")
            client.optim_step(types.AdamParams(learning_rate=3e-3)).result()
        path = client.save_weights_for_sampler("trained").result().path
        assert re.fullmatch(r"tinker://[0-9a-f]+:train:\d+/sampler_weights/trained", path)
        after = sdk.create_sampling_client(model_path=path)
        engine = np.asarray(after.compute_logprobs(types.ModelInput.from_ints(tokens)).result()[1:])
        trainer = np.asarray(client.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].data)
        np.testing.assert_allclose(engine, trainer, atol=1e-3)
        moved = engine[-len(answer):] - np.asarray(untrained[-len(answer):])
        assert moved.min() > 0.5, moved  # the trained answer got likelier: the engine serves the new weights
        greedy = after.sample(types.ModelInput.from_ints(prompt), num_samples=2,
                              sampling_params=types.SamplingParams(max_tokens=8, temperature=0.0)).result()
        assert [list(s.tokens) for s in greedy.sequences] == [answer, answer]
        assert all(s.stop_reason == "stop" and len(s.logprobs) == len(answer) for s in greedy.sequences)
        again = before.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
        np.testing.assert_allclose(np.asarray(again[1:]), np.asarray(untrained[1:]), atol=1e-5)
        drawn = before.sample(types.ModelInput.from_ints(prompt), num_samples=3,
                              sampling_params=types.SamplingParams(max_tokens=6, temperature=1.0, seed=1)).result()
        assert len(drawn.sequences) == 3 and all(len(s.tokens) == len(s.logprobs) for s in drawn.sequences)
        one = types.SamplingParams(max_tokens=1, temperature=0.0)
        tail = before.sample(types.ModelInput.from_ints(tokens), 1, one, include_prompt_logprobs=True,
                             prompt_logprobs_last_n=3).result().prompt_logprobs
        assert tail[:-3] == [None] * (len(tokens) - 3), tail
        np.testing.assert_allclose(tail[-3:], untrained[-3:], atol=1e-5)
        # Top-k: greedy's token is the likeliest, with its own log-prob; a prompt token among its position's
        # top 3 has the log-prob prompt_logprobs gives it, and the others are at least as likely as it.
        top = before.sample(types.ModelInput.from_ints(tokens), 1, one, include_prompt_logprobs=True,
                            topk_prompt_logprobs=3, topk_sample_logprobs=3).result()
        (sampled,) = top.sequences
        assert [row[0][0] for row in sampled.topk_logprobs] == sampled.tokens
        np.testing.assert_allclose([row[0][1] for row in sampled.topk_logprobs], sampled.logprobs, atol=1e-6)
        rows = top.topk_prompt_logprobs
        assert rows[0] is None and len(rows) == len(tokens) and all(len(row) == 3 for row in rows[1:])
        for token, own, row in zip(tokens[1:], top.prompt_logprobs[1:], rows[1:]):
            assert [lp for _, lp in row] == sorted((lp for _, lp in row), reverse=True)
            if token in dict(row):
                assert dict(row)[token] == pytest.approx(own, abs=1e-6)
            else:
                assert row[-1][1] >= own - 1e-6
        assert sum(token in dict(row) for token, row in zip(tokens[1:], rows[1:])) > 0
        with pytest.raises(tinker.BadRequestError, match="topk_sample_logprobs = 21: ask for 0 to 20"):
            before.sample(types.ModelInput.from_ints(tokens), 1, one, topk_sample_logprobs=21).result()
        # The engine keeps 4 versions of a client (the shipped keep_versions): those last saved or sampled.
        # `before`, sampled between saves, outlives 4 newer saves; `after`, left alone since, is retired.
        for k in range(4):
            client.save_weights_for_sampler(f"more{k}").result()
            again = before.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
            np.testing.assert_allclose(np.asarray(again[1:]), np.asarray(untrained[1:]), atol=1e-5)
        with pytest.raises(tinker.RequestFailedError, match="no longer served.*last saved or sampled"):
            for _ in range(40):  # the engine unloads a retired version off the save's path, within seconds
                after.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
                time.sleep(0.25)
    with tinker.ServiceClient(base_url=service.url, api_key=OTHER_KEY) as stranger:
        with pytest.raises(tinker.NotFoundError, match="no sampler weights"):
            stranger.create_sampling_client(model_path=path).result()


def test_a_saved_state_survives_a_restart_and_gives_the_identical_next_step(service: Service, dump: Path) -> None:
    """Last in the module: it stops the module's service."""
    client = tinker.ServiceClient(base_url=service.url, api_key=KEY).create_lora_training_client(
        base_model=NAME, rank=8, seed=3)
    data, probe = _batch(client.get_tokenizer(), 40), _batch(client.get_tokenizer(), 60, 2)
    for _ in range(3):
        _step(client, data)
    path = client.save_state("after-3").result().path
    assert path.endswith("/weights/after-3")
    sampler_path = client.save_weights_for_sampler("after-3").result().path
    tokens = probe[0].model_input.to_ints()
    sampled = np.asarray(client.create_sampling_client(sampler_path).compute_logprobs(
        types.ModelInput.from_ints(tokens)).result()[1:])
    expected_loss = _step(client, data)
    expected = _logprobs(client.forward(probe, "cross_entropy").result())
    service.stop()
    # Back on 2 trainer ranks (FSDP, the rows of each step split over them), with a new engine.
    again = Service(dump, nproc=2)
    try:
        # The named sampler weights, saved before the restart, go back into the new engine when asked for.
        reloaded = tinker.ServiceClient(base_url=again.url, api_key=KEY).create_sampling_client(sampler_path)
        ours = np.asarray(reloaded.compute_logprobs(types.ModelInput.from_ints(tokens)).result()[1:])
        np.testing.assert_allclose(ours, sampled, rtol=0, atol=1e-5)
        base = tinker.ServiceClient(base_url=again.url, api_key=KEY).create_sampling_client(base_model=NAME)
        assert np.abs(np.asarray(base.compute_logprobs(types.ModelInput.from_ints(tokens)).result()[1:])
                      - sampled).max() > 0.1  # the trained adapter, not the base
        resumed = tinker.ServiceClient(base_url=again.url, api_key=KEY).create_training_client_from_state_with_optimizer(
            path)
        assert resumed.get_info().lora_rank == 8
        assert _step(resumed, data) == pytest.approx(expected_loss, rel=1e-6)
        # 2 ranks sum the step's gradient in another order (~1e-7 apart), which Adam's g / sqrt(v) carries to
        # 1.8e-05 in these log-probs after the step (measured; 1 rank again: within 1e-6).
        for ours, theirs in zip(_logprobs(resumed.forward(probe, "cross_entropy").result()), expected):
            np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4)
        assert resumed.save_state("on-2-ranks").result().path.endswith("/weights/on-2-ranks")
        assert len(list(dump.glob("service_states/*/on-2-ranks.pt"))) == 1  # written once, by rank 0
        stranger = tinker.ServiceClient(base_url=again.url, api_key=OTHER_KEY)
        with pytest.raises(tinker.RequestFailedError, match="no saved state"):
            stranger.create_training_client_from_state(path).result()
        with pytest.raises(tinker.NotFoundError, match="no sampler weights"):
            stranger.create_sampling_client(model_path=sampler_path).result()
    finally:
        again.stop()
