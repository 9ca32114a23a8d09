"""GRPOObjective on hand-built samples: mask positions, the staleness filter, the gradient, DP normalisation.

The oracles are hand-derived. The "model" is a logit table, logits = table[input token], with every
input token distinct, so the gradient on table row `tok` is the gradient at the one position fed `tok`.
With a zero table, softmax is uniform and d loss / d logits[v] = g * (1[v = label] - 1/V), where g is
d loss / d logp at that position; so g = grad[tok, label] - grad[tok, any other column].
On-policy (ratio 1), the GRPO loss sum(-ratio * adv * mask) / tokens gives
g = -adv / tokens on completion positions and 0 elsewhere.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from dist_helpers import run_ranks

from titan_lora.config import GRPO
from titan_lora.rl.objective import GRPOObjective, completion_batch
from titan_lora.rl.sample_source import sample_source
from titan_lora.rl.rollout import Sample
from titan_lora.rl.task import build_task
from titan_lora.titan.parallel import DataParallelInfo

VOCAB = 64
PAD = 0
STEP = 5  # the engine serves version STEP - 1 = 4; max_staleness 1 keeps versions >= 3


class StubTokenizer:
    """Just what GRPOObjective's constructor reads: a chat template, encoding, eos and pad ids."""

    eos_token_id = PAD
    pad_token_id = None
    eos_token = "<eos>"

    def apply_chat_template(self, messages: list, tokenize: bool, add_generation_prompt: bool) -> str:
        return messages[0]["content"]

    def __call__(self, text: str, add_special_tokens: bool) -> dict[str, list[int]]:
        return {"input_ids": [1 + ord(c) % (VOCAB - 1) for c in text]}


class LogitTable(nn.Module):
    """logits[b, t] = table[inputs[b, t]]: one independent row of logits per input token."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.zeros(VOCAB, VOCAB))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.table[inputs]


def _objective(dp: DataParallelInfo | None = None, **overrides) -> GRPOObjective:
    settings = dict(enabled=True, train_size=10, eval_size=2, max_staleness=1) | overrides
    cfg = GRPO(**settings)
    dp = dp or DataParallelInfo(0, 1, None)
    return GRPOObjective(cfg, build_task(cfg), StubTokenizer(), None, dp, torch.device("cpu"), None, sample_source(cfg))


def _sample(first: int, n_prompt: int, n_completion: int, version: int, advantage: float) -> Sample:
    """Token ids first, first + 1, ... (distinct across samples when `first` values are spaced)."""
    ids = list(range(first, first + n_prompt + n_completion))
    engine_logprobs = [-math.log(VOCAB)] * n_completion  # what the zero table gives: the policy that drew it
    return Sample(ids[:n_prompt], ids[n_prompt:], engine_logprobs, 1.0 + advantage, advantage, version, "")


def _hand_samples() -> list[Sample]:
    """Six samples: versions 4, 4, 3, 3 (fresh) and 2, 2 (stale); 2 + 3 + 1 + 2 fresh completion tokens."""
    return [
        _sample(1, 3, 2, version=4, advantage=1.0),
        _sample(10, 2, 3, version=4, advantage=-0.5),
        _sample(20, 4, 1, version=3, advantage=2.0),
        _sample(30, 2, 2, version=3, advantage=-1.5),
        _sample(40, 3, 2, version=2, advantage=3.0),
        _sample(50, 2, 2, version=2, advantage=-3.0),
    ]


def _loss(obj: GRPOObjective, samples: list[Sample], model: nn.Module) -> tuple[torch.Tensor, dict]:
    obj._samples = lambda step: samples  # type: ignore[method-assign]
    return obj.loss(model, STEP)


def _dlogp(table_grad: torch.Tensor, input_tok: int, label: int) -> float:
    """d loss / d logp at the position whose input is `input_tok` (see the module docstring)."""
    other = next(v for v in range(VOCAB) if v != label)
    return float(table_grad[input_tok, label] - table_grad[input_tok, other])


def _expected_dlogp(samples: list[Sample], tokens: int) -> dict[int, float]:
    """Hand oracle: input token -> d loss / d logp; -adv / tokens where the label is a completion token."""
    out = {}
    for s in samples:
        seq = s.prompt_ids + s.completion_ids
        for t in range(len(seq) - 1):
            out[seq[t]] = -s.advantage / tokens if t + 1 >= len(s.prompt_ids) else 0.0
    return out


# ---------------------------------------------------------------- completion_batch


def test_completion_batch_masks_exactly_the_completion_labels() -> None:
    a = Sample([10, 11, 12], [20, 21], [], 0.0, 0.0, 0, "")
    b = Sample([10, 11], [30], [], 0.0, 0.0, 0, "")
    inputs, labels, mask = completion_batch([a, b], pad_id=PAD)
    # Hand-derived: a = 10 11 12 | 20 21 -> inputs 10 11 12 20, labels 11 12 20 21, completion labels at 2, 3.
    assert inputs.tolist() == [[10, 11, 12, 20], [10, 11, PAD, PAD]]
    assert labels.tolist() == [[11, 12, 20, 21], [11, 30, PAD, PAD]]
    assert mask.tolist() == [[0, 0, 1, 1], [0, 1, 0, 0]]


# ---------------------------------------------------------------- the staleness filter


def test_stale_samples_are_dropped_counted_and_get_no_gradient() -> None:
    obj = _objective()
    samples = _hand_samples()
    model = LogitTable()
    loss, metrics = _loss(obj, samples, model)
    loss.backward()
    assert metrics["rl/samples"] == 4 and metrics["rl/dropped_stale"] == 2
    assert metrics["rl/sample_version"] == 3.0
    assert metrics["rl/reward_mean"] == pytest.approx(1.0 + (1.0 - 0.5 + 2.0 - 1.5) / 4)
    fresh, stale = samples[:4], samples[4:]
    for s in stale:  # no row fed by a stale sample's tokens moved
        assert torch.count_nonzero(model.table.grad[s.prompt_ids + s.completion_ids]) == 0
    for s in fresh:
        assert torch.count_nonzero(model.table.grad[s.prompt_ids[-1]]) > 0
    _loss(obj, samples, LogitTable())
    assert obj.source.dropped() == 4, "the drop count accumulates over steps"


def test_a_resumed_run_drops_the_record_lines_of_the_steps_it_trains_again(tmp_path) -> None:
    # A run killed after writing step 5's line resumes from the checkpoint of step 3: steps 4 and 5 are
    # trained again, so their old lines go and the file ends with one line per step.
    record = tmp_path / "rollouts.jsonl"
    record.write_text("".join(json.dumps({"step": n, "groups": [n]}) + "\n" for n in range(1, 6)))
    cfg = GRPO(enabled=True, train_size=10, eval_size=2)
    obj = GRPOObjective(cfg, build_task(cfg), StubTokenizer(), None, DataParallelInfo(0, 1, None),
                        torch.device("cpu"), None, sample_source(cfg), record=str(record))
    obj.before_training(3)
    assert [json.loads(line)["step"] for line in record.read_text().splitlines()] == [1, 2, 3]
    obj.before_training(0)  # a new run in the same folder starts the file afresh
    assert record.read_text() == ""


def test_the_staleness_bound_follows_max_staleness() -> None:
    _, metrics = _loss(_objective(max_staleness=0), _hand_samples(), LogitTable())
    assert (metrics["rl/samples"], metrics["rl/dropped_stale"]) == (2, 4)
    _, metrics = _loss(_objective(max_staleness=2), _hand_samples(), LogitTable())
    assert (metrics["rl/samples"], metrics["rl/dropped_stale"]) == (6, 0)


# ---------------------------------------------------------------- the loss and its gradient


def test_on_policy_loss_and_gradient_are_minus_advantage_over_tokens() -> None:
    samples = _hand_samples()[:4]
    model = LogitTable()
    loss, metrics = _loss(_objective(), samples, model)
    tokens = 2 + 3 + 1 + 2
    # ratio 1: loss = -sum(adv_i * completion_tokens_i) / tokens
    want = -(1.0 * 2 - 0.5 * 3 + 2.0 * 1 - 1.5 * 2) / tokens
    assert loss.item() == pytest.approx(want, abs=1e-6)
    assert metrics["loss"] == pytest.approx(want, abs=1e-6)
    assert metrics["rl/kl"] == 0.0
    loss.backward()
    for tok, g in _expected_dlogp(samples, tokens).items():
        label = tok + 1  # every sample's ids are consecutive
        assert _dlogp(model.table.grad, tok, label) == pytest.approx(g, abs=1e-6), f"input token {tok}"


def test_a_sample_of_an_older_version_is_weighed_by_the_engine_log_probs_it_was_drawn_with() -> None:
    # Version 3 is kept (max_staleness 1) but the trainer is at 4. Decoupled PPO: the ratio is taken against
    # the current policy (1 here) and each token is weighed by p_current / p_engine,
    # capped at stale_weight_cap = 2: token 1 drew with p/3 (weight 3, capped to 2), token 2 with p/1.1.
    ln_v = math.log(VOCAB)
    s = Sample([1, 2], [3, 4], [-ln_v - math.log(3.0), -ln_v - math.log(1.1)], 2.0, 1.0, STEP - 2, "")
    model = LogitTable()
    loss, metrics = _loss(_objective(stale_weight_cap=2.0), [s], model)
    assert loss.item() == pytest.approx(-(2.0 + 1.1) / 2, abs=1e-5)
    assert metrics["rl/logprob_gap_max"] == 0.0, "the gap measures current-version samples only"
    assert metrics["rl/staleness_mean"] == 1.0 and metrics["rl/staleness_max"] == 1.0
    # k3 of KL(behaviour || current) per token: r - 1 - ln r with r = p_current / p_engine = 3, then 1.1
    k3 = lambda r: r - 1 - math.log(r)  # noqa: E731
    assert metrics["rl/mismatch_kl_s1"] == pytest.approx((k3(3.0) + k3(1.1)) / 2, rel=1e-5)
    assert "rl/mismatch_kl_s0" not in metrics, "no sample of the current version"
    loss.backward()
    assert _dlogp(model.table.grad, 2, 3) == pytest.approx(-2.0 / 2, abs=1e-5), "capped weight"
    assert _dlogp(model.table.grad, 3, 4) == pytest.approx(-1.1 / 2, abs=1e-5)


def test_a_current_version_sample_gets_no_importance_weight_whatever_the_engine_said() -> None:
    # Staleness 0: the sample is on-policy; its engine log-probs (here far off) only feed the parity gap.
    ln_v = math.log(VOCAB)
    s = Sample([1, 2], [3, 4], [-ln_v - 0.5, -ln_v + 0.25], 2.0, 1.0, STEP - 1, "")
    loss, metrics = _loss(_objective(), [s], LogitTable())
    assert loss.item() == pytest.approx(-1.0, abs=1e-6)
    assert metrics["rl/logprob_gap_max"] == pytest.approx(0.5, abs=1e-6)
    assert metrics["rl/mismatch_kl_s0"] == pytest.approx(((math.exp(0.5) - 1 - 0.5) + (math.exp(-0.25) - 1 + 0.25)) / 2,
                                                         rel=1e-5)


def test_the_async_loop_refuses_a_sample_older_than_max_staleness_instead_of_training_it() -> None:
    s = _sample(1, 2, 2, version=STEP - 3, advantage=1.0)  # staleness 2 > 1
    with pytest.raises(RuntimeError, match=r"versions \[2\], older than \[grpo\] max_staleness = 1"):
        _loss(_objective(loop="async"), [s], LogitTable())


def test_a_positive_advantage_raises_the_sampled_tokens_probability() -> None:
    sample = _sample(1, 2, 2, version=4, advantage=1.0)
    model = LogitTable()
    loss, _ = _loss(_objective(), [sample], model)
    loss.backward()
    with torch.no_grad():
        model.table -= 0.5 * model.table.grad  # one SGD step
    before = -torch.log(torch.tensor(float(VOCAB)))
    after = torch.log_softmax(model.table[2], -1)[3]  # input 2 -> completion token 3
    assert after > before + 0.1


def test_kl_term_is_zero_and_leaves_the_gradient_when_the_adapter_is_off() -> None:
    """A model with no LoRA layer is its own reference: k3 KL = 0, gradient unchanged."""
    samples = _hand_samples()[:4]
    plain, with_kl = LogitTable(), LogitTable()
    _loss(_objective(), samples, plain)[0].backward()
    loss, metrics = _loss(_objective(kl_coef=0.5), samples, with_kl)
    loss.backward()
    assert metrics["rl/kl"] == 0.0
    assert torch.allclose(with_kl.table.grad, plain.table.grad, atol=1e-7)


# ---------------------------------------------------------------- token normalisation over DP ranks


def _dp_rank(rank: int, world: int, out: str) -> None:
    obj = _objective(DataParallelInfo(rank, world, dist.group.WORLD))
    model = LogitTable()
    loss, metrics = _loss(obj, _hand_samples(), model)
    loss.backward()
    sums = torch.cat([loss.detach().view(1), model.table.grad.flatten()])
    dist.all_reduce(sums)  # FSDP sums gradients over DP ranks (divide factor 1)
    if rank == 0:
        torch.save({"loss": sums[0], "grad": sums[1:].view(VOCAB, VOCAB), "metrics": metrics}, out)


def test_two_dp_ranks_give_the_one_rank_loss_and_gradient(tmp_path) -> None:
    run_ranks(2, _dp_rank, str(tmp_path / "two.pt"))
    two = torch.load(tmp_path / "two.pt")
    model = LogitTable()
    loss, metrics = _loss(_objective(), _hand_samples(), model)
    loss.backward()
    # Rank 0 holds fresh samples 0-1 (5 tokens), rank 1 samples 2-3 (3 tokens): uneven on purpose.
    assert two["loss"].item() == pytest.approx(loss.item(), abs=1e-6)
    assert torch.allclose(two["grad"], model.table.grad, atol=1e-7)
    assert two["metrics"]["loss"] == pytest.approx(metrics["loss"], abs=1e-6)
    assert two["metrics"]["rl/samples"] == metrics["rl/samples"] == 4


# ---------------------------------------------------------------- the output head on completion positions only


def _head_on_completions(rank: int, world: int, out: str) -> None:
    from model_helpers import DEBUG_LORA, build_from, full_copy, randomize_adapters

    from titan_lora.rl.logprobs import token_logprobs

    model = build_from(DEBUG_LORA).model
    randomize_adapters(model)
    g = torch.Generator().manual_seed(rank)
    inputs, labels = (torch.randint(0, 256, (3, 20), generator=g) for _ in range(2))
    mask = torch.zeros(3, 20)
    mask[0, 15:], mask[1, 12:19], mask[2, 19:] = 1, 1, 1  # ragged completions, as GRPO batches are
    head_rows = []
    hook = model.lm_head.register_forward_pre_hook(lambda _m, args: head_rows.append(args[0].shape[:-1]))
    results = {}
    for name, m in (("cut", mask), ("whole", None)):
        model.zero_grad()
        logp = token_logprobs(model, inputs, labels, m)
        (logp * mask).sum().backward()
        grads = [full_copy(p.grad) for p in model.parameters() if p.requires_grad]
        results[name] = (logp.detach(), grads)
    hook.remove()
    if rank == 0:
        torch.save({"results": results, "rows": head_rows, "mask": mask}, out)


def test_the_output_head_runs_on_completion_positions_only_with_the_same_logprobs_and_grads(tmp_path) -> None:
    """GRPO's log-probs with the head cut to the completion tokens (10 of 60 positions here) equal those of
    the whole logits there, and are 0 elsewhere; the adapter gradients agree, on 2 FSDP ranks."""
    run_ranks(2, _head_on_completions, str(tmp_path / "head.pt"))
    saved = torch.load(tmp_path / "head.pt")
    (cut, cut_grads), (whole, whole_grads) = saved["results"]["cut"], saved["results"]["whole"]
    mask = saved["mask"].bool()
    assert [tuple(r) for r in saved["rows"]] == [(int(mask.sum()),), (3, 20)], "the head ran on every position"
    torch.testing.assert_close(cut[mask], whole[mask], rtol=0, atol=1e-5)
    assert torch.count_nonzero(cut[~mask]) == 0
    for a, b in zip(cut_grads, whole_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
