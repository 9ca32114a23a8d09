"""`[compile] enable = true` with LoRA: torchtitan's per-block torch.compile between AC and FSDP2. The compiled
model keeps clean adapter names and gives eager's loss and adapter gradients: on 2 gloo ranks with the
aot_eager backend (it traces and partitions like inductor but needs no C++ compiler, so CPU CI runs it), and
with `pytest -m gpu` on 2 NCCL ranks with inductor (fp32; its fused kernels reorder sums, hence the tolerance)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dist_helpers import needs_gpus, rank_device, run_ranks
from model_helpers import DEBUG_LORA, build_from, full_copy, randomize_adapters

from titan_lora.lora.layer import adapter_params

COMPILED = DEBUG_LORA + '[compile]\nenable = true\ncomponents = ["model"]\nbackend = "{backend}"\n'
TOKENS = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))


def _loss_and_grads(toml: str) -> tuple[float, dict[str, torch.Tensor], torch.nn.Module]:
    torch.manual_seed(0)  # the base's random init
    model = build_from(toml).model
    randomize_adapters(model)
    tokens = TOKENS.to(rank_device())
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    grads = {name: full_copy(param.grad) for name, param in adapter_params(model)}
    return loss.item(), grads, model


def _compiled_matches_eager(rank: int, world: int, backend: str, rtol: float) -> None:
    eager_loss, eager_grads, _ = _loss_and_grads(DEBUG_LORA)
    loss, grads, model = _loss_and_grads(COMPILED.format(backend=backend))
    # torchtitan 0.3.0 compiles each block in place (`Module.compile`): its names stay as they were.
    assert all(block._compiled_call_impl is not None for block in model.layers.values()), "blocks not compiled"
    assert grads.keys() == eager_grads.keys()
    assert abs(loss - eager_loss) <= rtol * abs(eager_loss), (loss, eager_loss)
    for name, grad in grads.items():
        assert grad.abs().sum() > 0, f"{name}: no gradient reached the adapter"
        torch.testing.assert_close(grad, eager_grads[name], rtol=rtol, atol=rtol * 1e-2, msg=name)


@pytest.mark.slow
def test_compiled_blocks_give_eagers_loss_and_adapter_grads_on_two_ranks() -> None:
    run_ranks(2, _compiled_matches_eager, "aot_eager", 1e-5)


@needs_gpus(2)
def test_inductor_blocks_give_eagers_loss_and_adapter_grads_on_two_gpus() -> None:
    run_ranks(2, _compiled_matches_eager, "inductor", 1e-3, backend="nccl")
