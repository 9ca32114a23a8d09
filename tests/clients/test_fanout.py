"""What a replica set can serve (`fanout.combined_limits`): the least of every replica's limits."""

from __future__ import annotations

from titan_lora.clients.fanout import combined_limits
from titan_lora.transfer.protocol import EngineLimits


def test_the_set_serves_the_smallest_rank_and_slots_the_common_targets_and_expert_lora_only_if_all_do() -> None:
    gpu = EngineLimits(16, 9, frozenset({"q_proj", "v_proj"}), expert_lora=True)
    cpu = EngineLimits(8, 12, frozenset({"q_proj"}), expert_lora=False)
    receiver = EngineLimits(64, 8, None)
    assert combined_limits([gpu, cpu, receiver]) == EngineLimits(8, 8, frozenset({"q_proj"}), expert_lora=False)
    assert combined_limits([gpu, receiver]) == EngineLimits(16, 8, frozenset({"q_proj", "v_proj"}), expert_lora=True)
    assert combined_limits([receiver, receiver]).expert_lora is None
