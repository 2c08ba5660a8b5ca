"""Read a checkpoint's safetensors (one file or shards listed in an index) into a flat dict."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from pdengine.model.errors import CheckpointFileMissingError, ModelLoadError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def weight_files(checkpoint: Path) -> list[Path]:
    """The safetensors files of a checkpoint, in a deterministic order."""
    checkpoint = Path(checkpoint)
    index = checkpoint / INDEX_FILE
    if index.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ModelLoadError(f"{index}: not a safetensors index ({exc})") from exc
        files = [checkpoint / name for name in sorted(set(weight_map.values()))]
    elif (checkpoint / SINGLE_FILE).is_file():
        files = [checkpoint / SINGLE_FILE]
    else:
        files = sorted(checkpoint.glob("*.safetensors"))
        if not files:
            raise CheckpointFileMissingError(checkpoint / SINGLE_FILE, "no *.safetensors weights")
    for file in files:
        if not file.is_file():
            raise CheckpointFileMissingError(file, f"listed in {INDEX_FILE}")
    return files


def load_tensors(checkpoint: Path, dtype: torch.dtype, device: str | torch.device = "cpu"
                 ) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, cast to `dtype` on `device`."""
    tensors: dict[str, torch.Tensor] = {}
    for file in weight_files(checkpoint):
        with safe_open(str(file), framework="pt", device="cpu") as reader:
            for name in reader.keys():  # noqa: SIM118 - safe_open is not a Mapping
                tensors[name] = reader.get_tensor(name).to(device=device, dtype=dtype)
    return tensors


class TensorSource:
    """Hands out named tensors once each and reports what is missing or left over.

    A taken tensor is dropped from the source, so fusing (q|k|v, gate|up) does not
    keep a second copy of the weights alive while the model is built.
    """

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self._tensors = tensors

    def has(self, name: str) -> bool:
        return name in self._tensors

    def take(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self._tensors:
            raise ModelLoadError(f"checkpoint lacks tensor {name!r}")
        tensor = self._tensors[name]
        if tuple(tensor.shape) != shape:
            raise ModelLoadError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}; the config implies {shape}"
            )
        del self._tensors[name]
        return tensor

    def unused(self) -> list[str]:
        return sorted(self._tensors)
