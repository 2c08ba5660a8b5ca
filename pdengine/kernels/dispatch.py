"""Backend selection: the Triton kernels on CUDA, the torch twins otherwise.

Order of precedence: ``use_backend(...)`` context (tests), then the environment
variable ``PDENGINE_KERNELS=triton|torch``, then ``triton`` if
``torch.cuda.is_available()`` else ``torch``. Triton modules are imported
lazily, so the CPU path never needs a working Triton.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import os
from collections.abc import Iterator
from types import ModuleType

import torch

BACKENDS = ("triton", "torch")
ENV_VAR = "PDENGINE_KERNELS"

_forced: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "pdengine_kernels", default=None
)

_MODULES = {
    ("triton", "store_kv"): "pdengine.kernels.triton_store",
    ("triton", "paged_decode_attention"): "pdengine.kernels.triton_decode",
    ("triton", "paged_prefill_attention"): "pdengine.kernels.triton_prefill",
    ("torch", "store_kv"): "pdengine.kernels.reference",
    ("torch", "paged_decode_attention"): "pdengine.kernels.reference",
    ("torch", "paged_prefill_attention"): "pdengine.kernels.reference",
}


def _validate(name: str, source: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"{source}: unknown kernel backend {name!r}, expected one of {BACKENDS}")
    return name


def active_backend() -> str:
    """The backend the public kernel functions dispatch to right now."""
    forced = _forced.get()
    if forced is not None:
        return forced
    env = os.environ.get(ENV_VAR, "").strip().lower()
    if env:
        return _validate(env, ENV_VAR)
    return "triton" if torch.cuda.is_available() else "torch"


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Force a backend inside a ``with`` block (tests run Triton in the interpreter)."""
    token = _forced.set(_validate(name, "use_backend"))
    try:
        yield
    finally:
        _forced.reset(token)


def implementation(op: str, backend: str | None = None) -> object:
    """The function implementing ``op`` on ``backend`` (default: the active one)."""
    module: ModuleType = importlib.import_module(_MODULES[(backend or active_backend(), op)])
    return getattr(module, op)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    implementation("store_kv")(k, v, k_cache, v_cache, slot_mapping)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    num_kv_splits: int | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    fn = implementation("paged_decode_attention")
    return fn(q, k_cache, v_cache, page_table, seq_lens, sm_scale, num_kv_splits, max_seq_len)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_q_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    max_q_len: int | None = None,
) -> torch.Tensor:
    fn = implementation("paged_prefill_attention")
    return fn(q, k_cache, v_cache, page_table, cu_q_lens, seq_lens, sm_scale, max_q_len)
