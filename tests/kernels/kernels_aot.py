"""Compile the Triton kernels for real GPU targets without a GPU (ptxas ships with Triton).

The interpreter accepts code a GPU compiler rejects (tl.dot tiles under 16, bad casts,
too much shared memory); compiling to cubin for sm_90 (Hopper) and sm_100 (Blackwell)
with the launch table's parameters catches that on CPU-only CI. Run as a script in a
process without TRITON_INTERPRET (the interpreter replaces @triton.jit):

    python tests/kernels/kernels_aot.py ARCH DTYPE HEAD_DIM [KERNEL ...]  -> a JSON line per kernel
"""

from __future__ import annotations

import json
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pdengine.kernels import configs
from pdengine.kernels import triton_decode as td
from pdengine.kernels import triton_prefill as tp
from pdengine.kernels import triton_store as ts

CAPABILITY = {"hopper": 90, "blackwell": 100}
PTR = {"float32": "*fp32", "float16": "*fp16", "bfloat16": "*bf16"}
GROUP, PAGE_SIZE = 4, 16


def _compile(fn, pointers: dict, constexprs: dict, cc: int, cfg: configs.LaunchConfig) -> dict:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        else:
            sig[name] = pointers.get(name, "fp32" if name == "qk_scale" else "i32")
    kernel = triton.compile(
        ASTSource(fn, sig, constexprs),
        target=GPUTarget("cuda", cc, 32),
        options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages},
    )
    return {"kernel": fn.__name__, "cc": cc, "shared": kernel.metadata.shared}


def build(arch: str, dtype: str, head_dim: int, kernel: str) -> dict:
    cc, ptr = CAPABILITY[arch], PTR[dtype]
    precision = "ieee" if dtype == "float32" else "tf32"
    dec = configs.decode_config_for(arch, head_dim)
    pre = configs.prefill_config_for(arch, head_dim)
    kv = {"KCache": ptr, "VCache": ptr, "PageTable": "*i32", "SeqLens": "*i32"}
    if kernel == "decode_split":
        return _compile(
            td._decode_split_kernel,
            {**kv, "Q": ptr, "PartOut": "*fp32", "PartLse": "*fp32"},
            {"GROUP": GROUP, "BLOCK_H": 16, "HEAD_DIM": head_dim, "BLOCK_D": head_dim,
             "PAGE_SIZE": PAGE_SIZE, "BLOCK_N": dec.block_n, "UPCAST": False,
             "DOT_PRECISION": precision},
            cc, dec,
        )  # fmt: skip
    if kernel == "decode_merge":
        return _compile(
            td._decode_merge_kernel,
            {"PartOut": "*fp32", "PartLse": "*fp32", "Out": ptr},
            {"HEAD_DIM": head_dim, "BLOCK_D": head_dim, "BLOCK_S": 64},
            cc, configs.LaunchConfig(16, 16, 4, 1),
        )  # fmt: skip
    if kernel == "prefill":
        return _compile(
            tp._prefill_kernel,
            {**kv, "Q": ptr, "CuQLens": "*i32", "Out": ptr},
            {"GROUP": GROUP, "HEAD_DIM": head_dim, "BLOCK_D": head_dim, "PAGE_SIZE": PAGE_SIZE,
             "BLOCK_M": pre.block_m, "BLOCK_N": pre.block_n, "UPCAST": False,
             "DOT_PRECISION": precision},
            cc, pre,
        )  # fmt: skip
    if kernel == "store":
        return _compile(
            ts._store_kv_kernel,
            {"K": ptr, "V": ptr, "KCache": ptr, "VCache": ptr, "Slots": "*i64"},
            {"PAGE_SIZE": PAGE_SIZE, "HEAD_DIM": head_dim, "BLOCK_D": head_dim},
            cc, configs.LaunchConfig(16, 16, 4, 1),
        )  # fmt: skip
    raise SystemExit(f"unknown kernel {kernel!r}")


if __name__ == "__main__":
    arch, dtype, head_dim, *kernels = sys.argv[1:]
    for name in kernels or ["decode_split", "decode_merge", "prefill", "store"]:
        print(json.dumps(build(arch, dtype, int(head_dim), name)), flush=True)
