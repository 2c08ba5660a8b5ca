"""Backend dispatch: torch twins without CUDA, Triton when forced (env or context)."""

from __future__ import annotations

import pytest
import torch
from kernels_testlib import make_paged_kv

import pdengine.kernels as kernels
from pdengine.kernels import dispatch, reference, triton_decode


def test_default_backend_follows_cuda(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    expected = "triton" if torch.cuda.is_available() else "torch"
    assert kernels.active_backend() == expected


def test_env_and_context_override(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    assert kernels.active_backend() == "triton"
    assert dispatch.implementation("paged_decode_attention") is triton_decode.paged_decode_attention
    with kernels.use_backend("torch"):
        assert kernels.active_backend() == "torch"
        assert dispatch.implementation("store_kv") is reference.store_kv
    assert kernels.active_backend() == "triton"
    monkeypatch.setenv(dispatch.ENV_VAR, "cuda-magic")
    with pytest.raises(ValueError, match="PDENGINE_KERNELS"):
        kernels.active_backend()
    with pytest.raises(ValueError, match="use_backend"), kernels.use_backend("tpu"):
        pass


def test_public_api_gives_the_same_answer_on_both_backends():
    gen = torch.Generator().manual_seed(11)
    kv = make_paged_kv([20, 5], 16, 1, 16, torch.float32, gen)
    k = torch.randn(2, 1, 16, generator=gen)
    slots = torch.tensor([int(kv.page_table[0, 1]) * 16 + 4, int(kv.page_table[1, 0]) * 16 + 4])
    q = torch.randn(2, 2, 16, generator=gen)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    results = {}
    for backend in kernels.BACKENDS:
        pool = kv.pool.clone()
        kc, vc = pool[:, 1, 0], pool[:, 1, 1]
        with kernels.use_backend(backend):
            kernels.store_kv(k, k, kc, vc, slots)
            dec = kernels.paged_decode_attention(q, kc, vc, kv.page_table, kv.seq_lens, 0.25)
            pre = kernels.paged_prefill_attention(q, kc, vc, kv.page_table, cu, kv.seq_lens, 0.25)
        results[backend] = (pool, dec, pre)
    assert torch.equal(results["torch"][0], results["triton"][0])
    torch.testing.assert_close(results["torch"][1], results["triton"][1], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(results["torch"][2], results["triton"][2], atol=2e-5, rtol=1e-4)
    # Decode is prefill with one new token per sequence.
    torch.testing.assert_close(results["torch"][1], results["torch"][2], atol=1e-6, rtol=1e-5)
