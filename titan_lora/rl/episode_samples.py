"""Training samples from a captured episode (`transfer.episodes.EpisodeRecord`): one per segment.

A segment is one exact token stream: its ids up to the first sampled token are the prompt, the rest the
completion, and the segment's mask (1: sampled by the policy) and engine log-probs ride along, so the loss
and the engine-gap check cover exactly the mask-1 tokens. A multi-segment episode (a turn whose prompt did
not extend the stream: an edited history, a template that drops earlier turns) gives one sample per
segment, each with the episode's reward and advantage: every sampled token is trained, in the context it
was sampled in. A segment longer than `[training] seq_len` is cut to its first seq_len tokens (the
trainer's RoPE table and batch width) and the sampled tokens cut off are counted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from titan_lora.rl.rollout import Sample
from titan_lora.transfer.episodes import EpisodeRecord


@dataclasses.dataclass
class EpisodeCounts:
    """What turning episodes into samples left out or split, summed over a step (`rl/episode_*` metrics)."""

    episodes: int = 0
    segments: int = 0
    multi_segment: int = 0
    """Episodes of more than one segment (each segment trained as its own sequence)."""
    empty: int = 0
    """Episodes with no sampled token captured (nothing to train; their reward still counts in the group)."""
    truncated_tokens: int = 0
    """Sampled tokens past `[training] seq_len`, cut off and not trained."""
    agent_errors: int = 0
    """Episodes whose agent raised: reward 0, the turns captured before the error are trained."""
    reward_sum: float = 0.0
    """Over every episode, the empty ones included (`rl/reward_mean` averages the samples, one per segment)."""

    def metrics(self) -> dict[str, float]:
        """The counts as `rl/episode_<name>` metrics, and the episodes' mean reward."""
        counts = {f"rl/episode_{k}": float(v) for k, v in dataclasses.asdict(self).items() if k != "reward_sum"}
        return {**counts, "rl/episode_reward_mean": self.reward_sum / max(self.episodes, 1)}


def sum_counts(counts: Iterable[EpisodeCounts]) -> EpisodeCounts:
    """The field-wise sum of `counts` (the async loop's step: its groups' counts)."""
    total = EpisodeCounts()
    for c in counts:
        for field in dataclasses.fields(EpisodeCounts):
            setattr(total, field.name, getattr(total, field.name) + getattr(c, field.name))
    return total


def episode_samples(record: EpisodeRecord, reward: float, advantage: float, seq_len: int,
                    counts: EpisodeCounts) -> list[Sample]:
    """One sample per segment of `record` that holds a sampled token within its first `seq_len` tokens."""
    counts.episodes += 1
    counts.multi_segment += len(record.segments) > 1
    samples = []
    for segment in record.segments:
        if 1 not in segment.mask:
            continue
        counts.truncated_tokens += sum(segment.mask[seq_len:])
        ids, mask, logprobs = segment.ids[:seq_len], segment.mask[:seq_len], segment.logprobs[:seq_len]
        if 1 not in mask:
            continue
        first = mask.index(1)
        if first == 0:  # the engine starts every segment with a turn's prompt: a record without one is corrupt
            raise ValueError(f"episode {record.episode_id}: a segment starts with a sampled token, so it has no "
                             "prompt to condition on; the record did not come from titan_lora's engine capture")
        samples.append(Sample(list(ids[:first]), list(ids[first:]), list(logprobs[first:]), reward, advantage,
                              record.version, "", completion_mask=list(mask[first:])))
    counts.segments += len(samples)
    counts.empty += not samples
    return samples
