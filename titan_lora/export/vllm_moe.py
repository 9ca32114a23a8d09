"""A Qwen3-MoE adapter exported in PEFT's layout rewritten per expert, the layout vLLM 0.32 loads by default
(`transfer/moe_layout.py` says how).

Run: `python -m titan_lora.export.vllm_moe PEFT_DIR OUT_DIR`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from safetensors.torch import load_file

from titan_lora.export.peft import save_peft_dir
from titan_lora.transfer.moe_layout import per_expert_adapter


def to_vllm_moe(peft_dir: str | Path, out: str | Path) -> Path:
    """Write the adapter in `peft_dir` (titan_lora's or PEFT's export) per expert to `out`."""
    peft_dir = Path(peft_dir)
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    if not config.get("target_parameters"):
        raise ValueError(f"{peft_dir} adapts no routed experts (no target_parameters): vLLM loads it as it is")
    tensors, config = per_expert_adapter(load_file(str(peft_dir / "adapter_model.safetensors")), config)
    return save_peft_dir(out, tensors, config)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m titan_lora.export.vllm_moe PEFT_DIR OUT_DIR")
    print(to_vllm_moe(sys.argv[1], sys.argv[2]))
