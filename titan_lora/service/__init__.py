"""A Tinker-compatible service: the `tinker` SDK's training calls served by titan_lora's trainer (`titan-lora serve`)."""
