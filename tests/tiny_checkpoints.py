"""Tiny random-init HF checkpoints made at test time with transformers, and the TOML that loads them."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from model_helpers import lora_toml

# SmolLM2's tokenizer (49152 ids) stands in where a checkpoint needs one: there is no hub access.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
SMOLLM2_VOCAB = 49152


CHAR_VOCAB = 128
"""The ids of `char_tokenizer`'s vocabulary (3 specials, newline and printable ASCII, padded)."""
CHAR_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'][0] }}: {{ m['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}a: {% endif %}")


def char_tokenizer(out: Path) -> Path:
    """A one-character-a-token tokenizer (<unk> 0, <s> 1, </s> 2, then newline and printable ASCII) with a
    chat template, saved to `out`: a random model of CHAR_VOCAB ids samples digits often enough to be
    rewarded on arithmetic, which one of SmolLM2's 49152 ids never is."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = ["<unk>", "<s>", "</s>", "\n", *(chr(c) for c in range(32, 127))]
    backend = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>", pad_token="<unk>")
    tokenizer.chat_template = CHAR_CHAT_TEMPLATE
    tokenizer.save_pretrained(str(out))
    return out


def _randomize_norms(model: torch.nn.Module) -> None:
    with torch.no_grad():  # HF's init leaves norms at 1; random norms exercise the mapping more
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)


def _save(model, out: Path, tokenizer_from: Path | None, shard_mb: float | None) -> Path:
    kwargs = {"max_shard_size": f"{int(shard_mb * 1000)}KB"} if shard_mb else {}
    model.save_pretrained(str(out), safe_serialization=True, **kwargs)
    for f in TOKENIZER_FILES if tokenizer_from else ():
        if (tokenizer_from / f).exists():
            shutil.copy(tokenizer_from / f, out / f)
    return out


def _tiny(config_cls, model_cls, out: Path, vocab: int, tied: bool,
          tokenizer_from: Path | None, shard_mb: float | None, seed: int, kv_heads: int = 2,
          **shape: object) -> Path:
    """2 layers, 4 query and `kv_heads` KV heads, eos 2, random norms: `model_cls(config_cls(**shape, ...))`,
    saved to `out`."""
    config = config_cls(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=kv_heads, max_position_embeddings=256, tie_word_embeddings=tied,
                        eos_token_id=2, **shape)
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    _randomize_norms(model)
    return _save(model, out, tokenizer_from, shard_mb)


def tiny_llama(out: Path, vocab: int = 256, tied: bool = True, tokenizer_from: Path | None = None,
               shard_mb: float | None = None, seed: int = 0, kv_heads: int = 2) -> Path:
    """A Llama with GQA (4 query heads, `kv_heads` KV heads of 16), saved to `out` (sharded: `shard_mb`)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _tiny(LlamaConfig, LlamaForCausalLM, out, vocab, tied, tokenizer_from, shard_mb, seed, kv_heads,
                 intermediate_size=160, rms_norm_eps=1e-5,
                 rope_parameters={"rope_type": "default", "rope_theta": 1e4})


def tiny_qwen3(out: Path, vocab: int = 256, tied: bool = False, tokenizer_from: Path | None = None,
               shard_mb: float | None = None, seed: int = 0, kv_heads: int = 2) -> Path:
    """A Qwen3 with q/k norms and head_dim 32 != hidden / heads = 16 (4 query, `kv_heads` KV heads), saved
    to `out`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return _tiny(Qwen3Config, Qwen3ForCausalLM, out, vocab, tied, tokenizer_from, shard_mb, seed, kv_heads,
                 intermediate_size=128, head_dim=32, rms_norm_eps=1e-6,
                 rope_parameters={"rope_type": "default", "rope_theta": 1e6})


def tiny_qwen3_moe(out: Path, vocab: int = 256, tied: bool = False, tokenizer_from: Path | None = None,
                   shard_mb: float | None = None, seed: int = 0, kv_heads: int = 2) -> Path:
    """A Qwen3-MoE as `tiny_qwen3`, with 4 experts of width 32 (top 2, renormalised) in layer 0 and a dense
    SwiGLU of 96 in layer 1 (`mlp_only_layers`), saved to `out`."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return _tiny(Qwen3MoeConfig, Qwen3MoeForCausalLM, out, vocab, tied, tokenizer_from, shard_mb, seed, kv_heads,
                 intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                 norm_topk_prob=True, mlp_only_layers=[1], head_dim=32, rms_norm_eps=1e-6,
                 rope_parameters={"rope_type": "default", "rope_theta": 1e6})


def hf_toml(name: str, hf_dir: Path, rank: int = 8, alpha: int = 16) -> str:
    """A LoRA job on the checkpoint in `hf_dir` through `[model] name`; no flavor: config.json gives the shape."""
    return lora_toml(f'name = "{name}"\nhf_assets_path = "{hf_dir}"\nload_pretrained = true', rank, alpha)


def hf_model(hf_dir: Path):
    """The checkpoint back through transformers, fp32, eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
