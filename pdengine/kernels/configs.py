"""Launch parameters per GPU architecture (and for the CPU interpreter).

Block sizes, warps and pipeline stages live here, not in kernel bodies, so a new
architecture is one table row. Only portable ``tl`` operations are used by the
kernels (no TMA/wgmma-only paths), so every row runs on Hopper and Blackwell;
the rows only tune.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int  # query rows per program (prefill)
    block_n: int  # KV tokens per tile
    num_warps: int
    num_stages: int


# Decode is bandwidth-bound: moderate tiles, deep pipelining to keep loads in flight.
_DECODE = {
    "interpreter": LaunchConfig(block_m=16, block_n=16, num_warps=1, num_stages=1),
    "hopper": LaunchConfig(block_m=16, block_n=64, num_warps=4, num_stages=3),
    "blackwell": LaunchConfig(block_m=16, block_n=64, num_warps=4, num_stages=3),
    "default": LaunchConfig(block_m=16, block_n=64, num_warps=4, num_stages=2),
}
# Prefill is compute-bound: large query tiles amortise every K/V load.
_PREFILL = {
    "interpreter": LaunchConfig(block_m=16, block_n=16, num_warps=1, num_stages=1),
    "hopper": LaunchConfig(block_m=128, block_n=64, num_warps=8, num_stages=3),
    "blackwell": LaunchConfig(block_m=128, block_n=64, num_warps=8, num_stages=3),
    "default": LaunchConfig(block_m=64, block_n=64, num_warps=4, num_stages=2),
}


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def arch(device: torch.device) -> str:
    if interpreting() or device.type != "cuda":
        return "interpreter"
    major, _ = torch.cuda.get_device_capability(device)
    return {9: "hopper", 10: "blackwell", 12: "blackwell"}.get(major, "default")


def _shrink_for_head_dim(cfg: LaunchConfig, head_dim: int) -> LaunchConfig:
    # Wide heads need more registers per row: halve the tiles to stay resident.
    if head_dim > 128 and cfg.block_n > 32:
        return LaunchConfig(max(16, cfg.block_m // 2), cfg.block_n // 2, cfg.num_warps, 2)
    return cfg


def decode_config_for(arch_name: str, head_dim: int) -> LaunchConfig:
    return _shrink_for_head_dim(_DECODE[arch_name], head_dim)


def prefill_config_for(arch_name: str, head_dim: int) -> LaunchConfig:
    return _shrink_for_head_dim(_PREFILL[arch_name], head_dim)


def decode_config(device: torch.device, head_dim: int) -> LaunchConfig:
    return decode_config_for(arch(device), head_dim)


def prefill_config(device: torch.device, head_dim: int) -> LaunchConfig:
    return prefill_config_for(arch(device), head_dim)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of the device (a nominal 132 off-GPU, an H100's count)."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count
