"""GRPO's pure pieces: group-normalised advantages, the policy-gradient loss, the staleness weights and the
k3 KL estimate."""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """(r - mean of its group) / (std of its group + eps), for rewards laid out group after group."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.view(-1, group_size)
    mean = grouped.mean(dim=1, keepdim=True)
    std = grouped.std(dim=1, keepdim=True, unbiased=False)
    return ((grouped - mean) / (std + eps)).view(-1)


def policy_loss(logp: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """Per-token policy-gradient loss -ratio x advantage, the ratio taken against the proximal policy (the
    current parameters, detached): its value is -advantage and its gradient -advantage x d logp. Shapes:
    [N, T] and [N].

    One update per batch leaves nothing for a PPO clip to cut (the ratio is exactly 1), so there is none;
    the policy change before the step is what `stale_weights` corrects."""
    return -torch.exp(logp - logp.detach()) * advantages[:, None]


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate exp(ref - logp) - (ref - logp) - 1 (always >= 0)."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1.0


def stale_weights(prox_logp: torch.Tensor, behaviour_logp: torch.Tensor, stale: torch.Tensor,
                  cap: float) -> torch.Tensor:
    """Per-token importance weight pi_prox / pi_behaviour, truncated at `cap`, where `stale` ([N, 1] or
    [N, T]) is set; 1 elsewhere. No gradient flows through it.

    Decoupled PPO (AReaL): a sample drawn under an older version is weighed by how much likelier the
    current (proximal) policy finds its tokens than the policy that drew them, and the policy ratio is
    taken against the proximal policy, so a change that happened before the step is this weight's to
    correct, not the ratio's."""
    weight = torch.exp(prox_logp.detach() - behaviour_logp).clamp(max=cap)
    return torch.where(stale.bool(), weight, torch.ones_like(weight))


def mismatch_kl(behaviour_logp: torch.Tensor, prox_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi_behaviour || pi_prox) on tokens drawn from pi_behaviour (>= 0)."""
    return k3_kl(behaviour_logp, prox_logp.detach())
