"""Rotary position embedding (half-split layout), with linear and llama3 frequency scaling."""

from __future__ import annotations

import math

import torch

from pdengine.model.config import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Per-pair rotation frequencies [head_dim // 2], float32."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    return _llama3(inv_freq, scaling)


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, and the band in between
    # interpolated linearly in (context / wavelength).
    context = s.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    long_wavelen = context / s.low_freq_factor
    short_wavelen = context / s.high_freq_factor
    slowed = torch.where(wavelen > long_wavelen, inv_freq / s.factor, inv_freq)
    blend = (context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    interpolated = (1 - blend) * slowed / s.factor + blend * slowed
    in_band = (wavelen >= short_wavelen) & (wavelen <= long_wavelen)
    return torch.where(in_band, interpolated, slowed)


class Rotary:
    """Computes cos/sin for a batch of absolute positions and rotates q and k in place-free ops."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None) -> None:
        self.inv_freq = inverse_frequencies(head_dim, theta, scaling)

    def to(self, device: torch.device | str) -> Rotary:
        self.inv_freq = self.inv_freq.to(device)
        return self

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """[T, 1, head_dim] cos and sin (heads broadcast), computed in float32."""
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)[:, None, :]
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; pairs are (i, i + D/2)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, rotated, sin)
