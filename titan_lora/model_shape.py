"""A decoder's shape, in no framework's terms: what a model family reads from config.json or names as a
flavor, and what the seam (`titan_lora.titan`) turns into torchtitan's model (0.2.2: model args; 0.3.0: a
config tree).

The bottom of the house: it imports nothing of titan_lora's, so the families above and the seam below share
one description of a model, and a torchtitan that reshapes its model configs changes the seam, not the
families.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's RoPE frequency scaling (config.json's `rope_type = "llama3"`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class MoEShape:
    """The routed experts of a mixture-of-experts decoder (Qwen3-MoE): softmax router, top-k, SwiGLU experts."""

    num_experts: int
    top_k: int
    hidden_dim: int
    """Each expert's SwiGLU inner width (config.json's `moe_intermediate_size`)."""
    norm_topk_prob: bool = True
    """The top-k routing weights renormalised to sum to 1 (config.json's `norm_topk_prob`)."""
    dense_layers: tuple[int, ...] = ()
    """Layers with a dense SwiGLU of `DecoderShape.ffn_hidden_dim` instead of experts (`mlp_only_layers`)."""

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} experts per token must be between 1 and num_experts "
                             f"{self.num_experts}")


@dataclasses.dataclass(frozen=True)
class DecoderShape:
    """The shape of a pre-norm decoder with SwiGLU FFNs (dense, or routed experts where `moe` says), grouped-query
    attention and RoPE."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_hidden_dim: int
    """The SwiGLU's inner width (config.json's `intermediate_size`)."""
    vocab_size: int
    norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None = None
    """None: RoPE frequencies unscaled."""
    qk_norm: bool = False
    """RMS-norm on each head's queries and keys (Qwen3)."""
    tied: bool = False
    """The output head is the token embedding (config.json's `tie_word_embeddings`)."""
    max_seq_len: int = 4096
    eos_id: int = 0
    moe: MoEShape | None = None
    """None: every layer dense; else the layers not in `moe.dense_layers` route tokens to experts."""

    def is_moe_layer(self, layer: int) -> bool:
        """True where layer `layer` holds routed experts rather than a dense SwiGLU."""
        return self.moe is not None and layer not in self.moe.dense_layers

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"{self.n_heads} attention heads cannot be grouped over {self.n_kv_heads} "
                             "key/value heads (n_heads must be a multiple of n_kv_heads)")
