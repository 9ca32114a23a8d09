"""The trainer's log-probs in row chunks (`rl/logprobs.py`): on 2 FSDP ranks with the debug LoRA model, the
chunked log-probs of the sampled tokens and the adapter gradients through them equal one forward's; every
forward (and each chunk's recompute in the backward) covers one chunk's rows, cut to its longest row; the
ranks agree on the chunk count though their batches differ; and a GRPO loss under a small chunk budget
equals the unchunked one (value, metrics and gradient)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_ranks
from test_grpo_objective import LogitTable, _hand_samples, _loss, _objective

from titan_lora.rl.logprobs import chunk_count, chunked_token_logprobs, token_logprobs

BUDGET = 40  # padded tokens a forward: rank 0's 4 x 20 batch needs 2 chunks, rank 1's 4 x 10 one


def _chunks(rank: int, world: int, out: str) -> None:
    from model_helpers import DEBUG_LORA, build_from, full_copy, randomize_adapters

    model = build_from(DEBUG_LORA).model
    randomize_adapters(model)
    width = 20 if rank == 0 else 10
    g = torch.Generator().manual_seed(rank)
    inputs, labels = (torch.randint(0, 256, (4, width), generator=g) for _ in range(2))
    mask = torch.zeros(4, width)
    mask[0, 5:9], mask[1, 3:width], mask[2, 2:4], mask[3, 6:8] = 1, 1, 1, 1  # ragged, as episodes are
    weights = torch.randn(4, width, generator=g)
    shapes: list[tuple[int, ...]] = []
    hook = model.register_forward_pre_hook(lambda _m, args: shapes.append(tuple(args[0].shape)))
    results = {}
    chunks = chunk_count(mask, BUDGET, dist.group.WORLD)
    for name, n in (("whole", 1), ("chunked", chunks)):
        model.zero_grad()
        shapes.clear()
        logp = chunked_token_logprobs(model, inputs, labels, mask, n)
        (logp * weights * mask).sum().backward()
        grads = [full_copy(p.grad) for p in model.parameters() if p.requires_grad]
        results[name] = (logp.detach(), grads, list(shapes))
    with torch.no_grad():
        shapes.clear()
        no_grad = chunked_token_logprobs(model, inputs, labels, mask, chunks)
    hook.remove()
    torch.save({"results": results, "mask": mask, "chunks": chunks, "no_grad": (no_grad, list(shapes)),
                "local": chunk_count(mask, BUDGET)}, f"{out}.{rank}")


def test_chunked_logprobs_and_gradients_equal_one_forwards_and_each_forward_holds_one_chunk(tmp_path) -> None:
    run_ranks(2, _chunks, str(tmp_path / "chunks.pt"))
    rank0, rank1 = (torch.load(tmp_path / f"chunks.pt.{r}") for r in (0, 1))
    assert (rank0["local"], rank1["local"]) == (2, 1) and rank0["chunks"] == rank1["chunks"] == 2, \
        "the ranks run as many forwards (each all-gathers) though rank 1's batch fits one"
    (whole, whole_grads, whole_shapes), (chunked, grads, shapes) = (rank0["results"][k] for k in ("whole", "chunked"))
    mask = rank0["mask"].bool()
    assert whole_shapes == [(4, 20)]
    # Rows 0-1 (longest sampled label at 19) and rows 2-3 (at 7): a forward and a recompute each.
    assert sorted(shapes) == [(2, 8), (2, 8), (2, 20), (2, 20)]
    assert rank0["no_grad"][1] == [(2, 20), (2, 8)], "without autograd: one forward a chunk, no recompute"
    torch.testing.assert_close(chunked[mask], whole[mask], rtol=0, atol=1e-5)
    assert torch.count_nonzero(chunked[~mask]) == 0
    torch.testing.assert_close(rank0["no_grad"][0], chunked, rtol=0, atol=1e-6)
    for a, b in zip(grads, whole_grads, strict=True):  # summed over both ranks by FSDP
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert sorted(rank1["results"]["chunked"][2]) == [(2, 8), (2, 8), (2, 10), (2, 10)], "rank 1 ran 2 chunks too"


def test_a_grpo_loss_under_a_small_chunk_budget_equals_the_unchunked_loss() -> None:
    plain_model, chunked_model = LogitTable(), LogitTable()
    plain_loss, plain = _loss(_objective(), _hand_samples(), plain_model)
    chunked_obj = _objective()
    chunked_obj.logprob_chunk_tokens = 1  # one row a forward
    rows: list[int] = []
    chunked_model.register_forward_pre_hook(lambda _m, args: rows.append(args[0].shape[0]))
    chunked_loss, chunked = _loss(chunked_obj, _hand_samples(), chunked_model)
    plain_loss.backward()
    chunked_loss.backward()
    assert rows and set(rows) == {1}, "every forward held one row"
    assert chunked_loss.item() == pytest.approx(plain_loss.item(), abs=1e-7)
    assert {k: chunked[k] for k in plain} == pytest.approx(plain, abs=1e-7)
    torch.testing.assert_close(chunked_model.table.grad, plain_model.table.grad, rtol=0, atol=1e-7)


def test_the_head_of_a_torchtitan_family_runs_on_the_masked_positions_alone() -> None:
    from model_helpers import DEBUG_LORA, build_from, randomize_adapters

    from titan_lora.titan.models import output_head

    model = build_from(DEBUG_LORA).model
    randomize_adapters(model)
    head = output_head(model)
    assert head is not None, "the family's output head is found by the seam's name (a rename would hide it)"
    rows: list[int] = []
    hook = head.register_forward_pre_hook(lambda _m, args: rows.append(args[0].shape[0]))
    g = torch.Generator().manual_seed(0)
    inputs, labels = (torch.randint(0, 256, (3, 12), generator=g) for _ in range(2))
    mask = torch.zeros(3, 12)
    mask[0, 4:7], mask[2, 1:3] = 1, 1
    with torch.no_grad():
        cut = token_logprobs(model, inputs, labels, mask)
        whole = token_logprobs(model, inputs, labels)
    hook.remove()
    assert rows[0] == 5, "the head saw the 5 masked positions, not the 36 of the batch"
    torch.testing.assert_close(cut, whole * mask, atol=1e-5, rtol=1e-5)
