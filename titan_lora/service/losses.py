"""The losses a Tinker client names in `forward_backward`, as pure functions of one datum's log-probs.

Tinker's losses are sums over tokens and datums, never means (the client normalises through `weights` or
`advantages`). Position i of a datum's model input predicts its `target_tokens[i]`; every per-token input has
the datum's length. The formulas are Tinker's documented ones (its "Loss Functions" pages): cross_entropy
-sum(w * logp); importance_sampling -sum(exp(logp - q) * A); ppo -sum(min(r * A, clip(r, lo, hi) * A));
cispo -sum(sg(clip(r, lo, hi)) * logp * A); gspo (GSPO-token) PPO's objective with every token's ratio
s_t = exp(mean over the `sequence_ratio_mask` tokens of sg(logp) - q + logp - sg(logp)): the sequence's
geometric-mean ratio as its value, the token's own log-prob as its gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import torch

LOSS_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
    "gspo": ("target_tokens", "logprobs", "advantages", "sequence_ratio_mask"),
}
"""The losses served and the `loss_fn_inputs` each needs (more keys are ignored)."""

PPO_CLIP = (0.8, 1.2)
"""PPO's default ratio bounds (epsilon 0.2), as Tinker documents them; GSPO's too (Tinker's GSPO page gives
no defaults of its own: set `clip_low_threshold` / `clip_high_threshold` in loss_fn_config to change them)."""
CISPO_CLIP = (0.0, 4.0)
"""CISPO's default bounds of its (detached) ratio coefficient."""


class LossInputError(ValueError):
    """A request's loss or its inputs are wrong: the request fails, no adapter changes."""


def check_loss(loss_fn: str, inputs: Mapping[str, torch.Tensor | np.ndarray], length: int, index: int) -> None:
    """Raise LossInputError unless datum `index` carries every input `loss_fn` needs, each `length` long."""
    if loss_fn not in LOSS_INPUTS:
        raise LossInputError(f"loss_fn {loss_fn!r} is not served; titan_lora serves {', '.join(LOSS_INPUTS)}")
    for key in LOSS_INPUTS[loss_fn]:
        if key not in inputs:
            raise LossInputError(f"datum {index}: loss_fn {loss_fn!r} needs loss_fn_inputs[{key!r}]; it has "
                                 f"{sorted(inputs)}")
        if inputs[key].shape != (length,):
            raise LossInputError(f"datum {index}: loss_fn_inputs[{key!r}] has shape {list(inputs[key].shape)}; "
                                 f"it must have one value per model-input token, [{length}]")
    if loss_fn == "gspo" and not np.any(np.asarray(inputs["sequence_ratio_mask"]) != 0):
        raise LossInputError(f"datum {index}: loss_fn_inputs['sequence_ratio_mask'] marks no token; gspo's "
                             "sequence ratio is the mean over the marked (sampled) tokens: mark at least one")


def _cross_entropy(logp: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]) -> torch.Tensor:
    return -(inputs["weights"] * logp).sum()


def _importance_sampling(logp: torch.Tensor, inputs: Mapping[str, torch.Tensor],
                         config: Mapping[str, float]) -> torch.Tensor:
    ratio = torch.exp(logp - inputs["logprobs"])
    return -(ratio * inputs["advantages"]).sum()


def _ppo(logp: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]) -> torch.Tensor:
    lo = config.get("clip_low_threshold", PPO_CLIP[0])
    hi = config.get("clip_high_threshold", PPO_CLIP[1])
    ratio = torch.exp(logp - inputs["logprobs"])
    advantages = inputs["advantages"]
    return -torch.minimum(ratio * advantages, ratio.clamp(lo, hi) * advantages).sum()


def _cispo(logp: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]) -> torch.Tensor:
    lo = config.get("clip_low_threshold", CISPO_CLIP[0])
    hi = config.get("clip_high_threshold", CISPO_CLIP[1])
    coefficient = torch.exp(logp - inputs["logprobs"]).clamp(lo, hi).detach()  # a weight, not a path for gradients
    return -(coefficient * logp * inputs["advantages"]).sum()


def _gspo(logp: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]) -> torch.Tensor:
    lo = config.get("clip_low_threshold", PPO_CLIP[0])
    hi = config.get("clip_high_threshold", PPO_CLIP[1])
    marked = inputs["sequence_ratio_mask"] != 0
    sequence = (logp.detach() - inputs["logprobs"])[marked].mean()
    ratio = torch.exp(sequence + logp - logp.detach())  # the sequence's value, the token's own gradient
    advantages = inputs["advantages"]
    return -torch.minimum(ratio * advantages, ratio.clamp(lo, hi) * advantages).sum()


_LOSSES: dict[str, Callable[[torch.Tensor, Mapping[str, torch.Tensor], Mapping[str, float]], torch.Tensor]] = {
    "cross_entropy": _cross_entropy, "importance_sampling": _importance_sampling, "ppo": _ppo, "cispo": _cispo,
    "gspo": _gspo,
}


def datum_loss(loss_fn: str, logp: torch.Tensor, inputs: Mapping[str, torch.Tensor],
               config: Mapping[str, float]) -> torch.Tensor:
    """One datum's loss under `loss_fn` (checked by `check_loss`): `logp` [N] are its target tokens' log-probs
    under the current weights."""
    return _LOSSES[loss_fn](logp, inputs, config)
