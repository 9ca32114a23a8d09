"""A dense decoder's shape, in no framework's terms: what a model family reads from config.json or names as a
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
class DecoderShape:
    """The shape of a dense pre-norm decoder with SwiGLU FFNs, grouped-query attention and RoPE."""

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

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"{self.n_heads} attention heads cannot be grouped over {self.n_kv_heads} "
                             "key/value heads (n_heads must be a multiple of n_kv_heads)")
