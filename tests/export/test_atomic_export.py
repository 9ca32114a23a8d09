"""The PEFT export is atomic and finite: a failed or refused write leaves the previous export as it was."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import titan_lora.export.peft as peft
from titan_lora.export.peft import save_peft_dir

NAME = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _export(tmp_path: Path, value: float) -> Path:
    return save_peft_dir(tmp_path / "adapter", {NAME: torch.full((2, 3), value)}, {"r": 2})


def test_an_export_replaces_the_previous_one_and_leaves_nothing_beside_it(tmp_path) -> None:
    _export(tmp_path, 1.0)
    out = _export(tmp_path, 2.0)
    assert torch.equal(load_file(out / "adapter_model.safetensors")[NAME], torch.full((2, 3), 2.0))
    assert json.loads((out / "adapter_config.json").read_text()) == {"r": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"], "temporary directories left behind"


def test_a_failure_in_the_middle_of_the_write_leaves_the_previous_export_intact(
    tmp_path, monkeypatch
) -> None:
    _export(tmp_path, 1.0)
    before = _files(tmp_path)

    def half_write(tensors, path):
        Path(path).write_bytes(b"\0" * 100)  # a partial file, then the disk fills up
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(peft, "save_file", half_write)
    with pytest.raises(OSError, match="No space left"):
        _export(tmp_path, 2.0)
    assert _files(tmp_path) == before, "the previous export changed, or a partial one was left beside it"


def test_a_non_finite_adapter_is_refused_and_nothing_is_written(tmp_path) -> None:
    _export(tmp_path, 1.0)
    before = _files(tmp_path)
    bad = {NAME: torch.ones(2, 3), NAME.replace("lora_A", "lora_B"): torch.tensor([[1.0, float("inf")]])}
    with pytest.raises(ValueError, match=r"non-finite adapter: .*q_proj\.lora_B\.weight holds NaN/Inf"):
        save_peft_dir(tmp_path / "adapter", bad, {"r": 2})
    assert _files(tmp_path) == before
    with pytest.raises(ValueError, match="non-finite"):
        save_peft_dir(tmp_path / "fresh", {NAME: torch.full((2, 3), float("nan"))}, {"r": 2})
    assert not (tmp_path / "fresh").exists()
