"""The rotary position embedding's frequencies (numpy only: the config validates with it)."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Rope:
    """The rotary embedding of one model: base `theta` and, for Llama 3, its frequency scaling.

    `scaling = "llama3"` (Hugging Face's `rope_type: llama3`, from `_compute_llama3_parameters`
    in transformers' modeling_rope_utils): frequencies whose wavelength is longer than
    original_max_len / low_freq_factor are divided by `factor`, those shorter than
    original_max_len / high_freq_factor are kept, and the band between is interpolated.
    """

    head_dim: int
    theta: float
    scaling: str = "none"  # none | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_len: int = 8192

    def inv_freq(self) -> np.ndarray:
        """[head_dim // 2] angular frequency of each channel pair, in float64."""
        inv_freq = 1.0 / self.theta ** (np.arange(0, self.head_dim, 2, dtype=np.float64)
                                        / self.head_dim)
        if self.scaling == "none":
            return inv_freq
        wavelen = 2 * np.pi / inv_freq
        low_freq_wavelen = self.original_max_len / self.low_freq_factor
        high_freq_wavelen = self.original_max_len / self.high_freq_factor
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
        smooth = ((self.original_max_len / wavelen - self.low_freq_factor)
                  / (self.high_freq_factor - self.low_freq_factor))
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return np.where(medium, smoothed, scaled)
