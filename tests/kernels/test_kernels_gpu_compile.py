"""The Triton kernels compile to cubin for Hopper and Blackwell with the launch table's
parameters, and fit in shared memory: GPU legality checked without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SHARED_LIMIT = 232_448  # bytes of shared memory one CTA may use on sm_90 and sm_100


def _compile(
    arch: str, dtype: str, head_dim: int, kernels: list[str], cache: Path
) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache)  # really compile, never a cached cubin
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(HERE / "kernels_aot.py"), arch, dtype, str(head_dim), *kernels],
        capture_output=True, text=True, env=env, timeout=280,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines()]


def test_decode_split_kernel_compiles_for_hopper(tmp_path):
    (result,) = _compile("hopper", "bfloat16", 128, ["decode_split"], tmp_path)
    assert result["kernel"] == "_decode_split_kernel" and result["cc"] == 90
    assert 0 < result["shared"] <= SHARED_LIMIT


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["hopper", "blackwell"])
@pytest.mark.parametrize(("dtype", "head_dim"),
                         [("bfloat16", 128), ("float16", 64), ("float32", 128), ("bfloat16", 256)])
def test_every_kernel_compiles(arch, dtype, head_dim, tmp_path):
    results = _compile(arch, dtype, head_dim, [], tmp_path)
    assert [r["kernel"] for r in results] == [
        "_decode_split_kernel", "_decode_merge_kernel", "_prefill_kernel", "_store_kv_kernel",
    ]  # fmt: skip
    for r in results:
        assert r["shared"] <= SHARED_LIMIT, r
