"""Prototype of the seam on torchtitan 0.3.0 (issue 34), imported by nothing yet: it runs only where
torchtitan 0.3.x is installed, and replaces `titan_lora.titan`'s 0.2.2 modules at the switch."""
