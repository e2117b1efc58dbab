"""A decoder-only language model trainer for Cloud TPU Multislice (and CPU emulation)."""
