"""The model a forker edits: the transformer, attention, RoPE, the loss and decoding."""
