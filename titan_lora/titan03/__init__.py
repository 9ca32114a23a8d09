"""Prototype of titan_lora on torchtitan 0.3.0 (branch tt03): model config trees (`model`), the LoRA
converter (`lora`) and FSDP/TP (`parallel`). Imported by nothing else yet; tests in tests/titan03 (run with
a 0.3.0 overlay on PYTHONPATH; they skip on 0.2.2)."""
