"""benchmarks/kernels_gpu.py stays runnable: its skip path and its --smoke logic."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels_gpu.py"


def _load():
    spec = importlib.util.spec_from_file_location("kernels_gpu_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module while being built
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="the skip path is for machines without CUDA")
def test_full_run_skips_cleanly_without_cuda(capsys):
    assert _load().main(["--json"]) == 0
    assert "no CUDA device" in json.loads(capsys.readouterr().out)["skipped"]


def test_smoke_run_measures_every_point(capsys):
    bench = _load()
    assert bench.main(["--smoke", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    sizes = bench.SMOKE
    points = {(p["batch"], p["context"]) for p in report["decode"]}
    assert points == {(b, c) for b in sizes.batches for c in sizes.contexts}
    assert report["copy_gbps"] > 0
    for p in report["decode"]:
        assert p["gbps"] > 0 and p["chooser_vs_best"] >= 1.0
        assert p["best_splits"] in {*sizes.splits, p["chosen_splits"]}
    assert [p["tokens"] for p in report["prefill"]] == sizes.prefill_lens
    assert all(p["paged_tflops"] > 0 and p["sdpa_tflops"] > 0 for p in report["prefill"])
