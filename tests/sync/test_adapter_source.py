"""The adapter as rank 0 publishes it equals the model's adapter renamed and permuted for PEFT."""

from __future__ import annotations

import torch
from dist_helpers import run_ranks
from model_helpers import DEBUG_LORA, build_from, job_config_from, randomize_adapters

from titan_lora.export.peft import to_peft_names
from titan_lora.lora.layer import adapter_params
from titan_lora.sync.adapter_source import AdapterSource
from titan_lora.transfer.buckets import bucket_checksum, bucket_size, plan_buckets
from titan_lora.transfer.transport import lend_buffer, offset_in


def _compare(rank: int, world: int) -> None:
    built = build_from(DEBUG_LORA)
    randomize_adapters(built.model)
    params = adapter_params(built.model)
    full = {n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for n, p in params}
    source = AdapterSource(built.model, built.peft_layout, job_config_from(DEBUG_LORA).lora, lend=lend_buffer)
    payload = source.snapshot(version=7)
    if rank == 0:  # compare before the next snapshot reuses the buffers
        expected = to_peft_names(full, built.peft_layout)
        assert payload.name == "policy-v7" and payload.version == 7
        assert list(payload.tensors) == list(expected)
        for name, tensor in expected.items():
            assert torch.equal(payload.tensors[name], tensor), name
        assert payload.nbytes == sum(t.numel() * t.element_size() for t in expected.values())
        assert payload.finite and payload.home is not None
        assert all(offset_in(payload.home, t) is not None for t in payload.tensors.values()), "in the lent buffer"
        # The checksum read with the finite check is the one bucket the emitter plans of these tensors.
        offset, size, checksum = payload.home_checksum
        [entries] = plan_buckets(payload.tensors, 1 << 40)
        assert (offset, size) == (offset_in(payload.home, payload.tensors[entries[0].name]), bucket_size(entries))
        assert checksum == bucket_checksum(payload.home.tensor[offset : offset + size])
    else:
        assert payload is None
    with torch.no_grad():  # every rank poisons its own shard of the first adapter tensor
        first = params[0][1]
        (first.to_local() if hasattr(first, "to_local") else first).fill_(float("nan"))
    poisoned = source.snapshot(version=8)  # collective: every rank takes part
    if rank == 0:
        assert not poisoned.finite


def test_without_a_lender_the_gather_writes_plain_memory() -> None:
    built = build_from(DEBUG_LORA)
    payload = AdapterSource(built.model, built.peft_layout, job_config_from(DEBUG_LORA).lora).snapshot(version=1)
    assert payload.home is None and payload.finite and payload.home_checksum is None


def test_snapshot_equals_peft_export_on_two_fsdp_ranks():
    run_ranks(2, _compare)
