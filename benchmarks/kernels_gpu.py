#!/usr/bin/env python3
"""GPU kernel benchmark: paged decode bandwidth and prefill TFLOP/s, with same-run baselines.

Decode: effective bandwidth = K/V bytes read / time, for batch x context, against a
device-to-device copy measured in the same run (copy bandwidth counts read + write).
For each point the chooser's split count is timed against every fixed split count.
Prefill: causal TFLOP/s of the paged kernel against torch SDPA (contiguous, causal) on
the same shapes. Aims (issue #4): decode >= 80% of copy bandwidth at long contexts;
chooser within 10% of the best fixed split.

Without CUDA it prints a skip line and exits 0. ``--smoke`` runs tiny sizes once
(on CPU through the Triton interpreter) so the script's logic stays exercised.

    benchmarks/kernels_gpu.py [--smoke] [--json] [--memory-fraction 0.5]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field


@dataclass
class Sizes:
    batches: list[int]
    contexts: list[int]
    prefill_lens: list[int]
    splits: list[int]
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    iters: int = 20
    copy_bytes: int = 1 << 30


FULL = Sizes(
    batches=[1, 8, 64, 256],
    contexts=[1024, 8192, 32768, 131072],
    prefill_lens=[1024, 4096, 16384],
    splits=[1, 2, 4, 8, 16, 32, 64],
)
SMOKE = Sizes(
    batches=[1, 2], contexts=[32, 48], prefill_lens=[32], splits=[1, 2],
    q_heads=2, kv_heads=1, head_dim=16, iters=1, copy_bytes=1 << 16,
)  # fmt: skip


@dataclass
class Report:
    device: str
    dtype: str
    copy_gbps: float = 0.0
    decode: list[dict] = field(default_factory=list)
    prefill: list[dict] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def _timer(torch, device) -> Callable[[Callable[[], object], int], float]:
    """Seconds per call of fn, averaged over iters after one warm-up call."""

    def run(fn: Callable[[], object], iters: int) -> float:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            torch.cuda.synchronize(device)
            return start.elapsed_time(end) / 1e3 / iters
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters

    return run


def _paged_kv(torch, sizes: Sizes, lens: list[int], dtype, device):
    """A 6-D pool (1 layer) with shuffled pages; returns the K/V views and page table."""
    pages = [-(-n // sizes.page_size) for n in lens]
    total = sum(pages)
    shape = (total, 1, 2, sizes.page_size, sizes.kv_heads, sizes.head_dim)
    pool = torch.randn(shape, dtype=dtype, device=device)
    order = torch.randperm(total, device=device).to(torch.int32)
    table = torch.zeros((len(lens), max(pages)), dtype=torch.int32, device=device)
    used = 0
    for b, n in enumerate(pages):
        table[b, :n] = order[used : used + n]
        used += n
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    return pool[:, 0, 0], pool[:, 0, 1], table, seq_lens


def bench_copy(torch, sizes: Sizes, dtype, device, timer) -> float:
    n = sizes.copy_bytes // torch.empty((), dtype=dtype).element_size()
    src = torch.empty(n, dtype=dtype, device=device).normal_()
    dst = torch.empty_like(src)
    seconds = timer(lambda: dst.copy_(src), sizes.iters)
    return 2 * sizes.copy_bytes / seconds / 1e9


def decode_point(torch, sizes: Sizes, batch: int, ctx: int, dtype, device, timer) -> dict:
    """One (batch, context) point: the chooser's split count against every fixed one."""
    from pdengine.kernels import choose_num_kv_splits
    from pdengine.kernels.configs import num_sms
    from pdengine.kernels.triton_decode import decode_kv_bytes, paged_decode_attention

    kc, vc, table, lens = _paged_kv(torch, sizes, [ctx] * batch, dtype, device)
    q = torch.randn(batch, sizes.q_heads, sizes.head_dim, dtype=dtype, device=device)
    scale = sizes.head_dim**-0.5
    chosen = choose_num_kv_splits(batch, sizes.q_heads, sizes.kv_heads, ctx, num_sms(device))

    def run(splits: int) -> None:
        paged_decode_attention(q, kc, vc, table, lens, scale, splits)

    times = {s: timer(lambda s=s: run(s), sizes.iters) for s in sorted({*sizes.splits, chosen})}
    best = min(times, key=times.__getitem__)
    itemsize = torch.empty((), dtype=dtype).element_size()
    gbytes = decode_kv_bytes(lens, sizes.kv_heads, sizes.head_dim, itemsize) / 1e9
    return {
        "batch": batch, "context": ctx, "chosen_splits": chosen, "best_splits": best,
        "chosen_us": times[chosen] * 1e6, "best_us": times[best] * 1e6,
        "chooser_vs_best": times[chosen] / times[best], "gbps": gbytes / times[chosen],
    }  # fmt: skip


def bench_decode(torch, sizes: Sizes, dtype, device, timer, budget: int, report: Report) -> None:
    itemsize = torch.empty((), dtype=dtype).element_size()
    for batch in sizes.batches:
        for ctx in sizes.contexts:
            kv_bytes = batch * ctx * sizes.kv_heads * sizes.head_dim * itemsize * 2
            if kv_bytes > budget:
                report.skipped.append(f"decode b={batch} ctx={ctx}: {kv_bytes / 2**30:.1f} GiB")
                continue
            point = decode_point(torch, sizes, batch, ctx, dtype, device, timer)
            point["fraction_of_copy"] = point["gbps"] / report.copy_gbps
            report.decode.append(point)
            if device.type == "cuda":
                torch.cuda.empty_cache()


def prefill_point(torch, sizes: Sizes, n: int, dtype, device, timer) -> dict:
    """Whole-prompt causal prefill of n tokens: paged kernel against torch SDPA."""
    import torch.nn.functional as F

    from pdengine.kernels.triton_prefill import paged_prefill_attention

    hq, hkv, d = sizes.q_heads, sizes.kv_heads, sizes.head_dim
    kc, vc, table, lens = _paged_kv(torch, sizes, [n], dtype, device)
    q = torch.randn(n, hq, d, dtype=dtype, device=device)
    cu = torch.tensor([0, n], dtype=torch.int32, device=device)
    scale = d**-0.5
    paged = timer(
        lambda: paged_prefill_attention(q, kc, vc, table, cu, lens, scale, max_q_len=n),
        sizes.iters,
    )
    qs = q.transpose(0, 1).unsqueeze(0)
    ks = torch.randn(1, hkv, n, d, dtype=dtype, device=device)
    vs = torch.randn_like(ks)
    sdpa = timer(
        lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                               enable_gqa=True),
        sizes.iters,
    )  # fmt: skip
    flops = 4 * hq * d * n * (n + 1) / 2  # QK^T and PV over the causal triangle
    return {
        "tokens": n, "paged_tflops": flops / paged / 1e12,
        "sdpa_tflops": flops / sdpa / 1e12, "paged_vs_sdpa": sdpa / paged,
    }  # fmt: skip


def _print_human(report: Report) -> None:
    print(f"device: {report.device}  dtype: {report.dtype}  copy: {report.copy_gbps:.1f} GB/s")
    print("decode  batch  context  splits(chosen/best)  GB/s   of-copy  chooser/best")
    for r in report.decode:
        splits = f"{r['chosen_splits']:6d}/{r['best_splits']:<4d}"
        print(f"        {r['batch']:5d}  {r['context']:7d}  {splits}       {r['gbps']:7.1f}"
              f"  {r['fraction_of_copy']:6.1%}  {r['chooser_vs_best']:.2f}")  # fmt: skip
    print("prefill tokens  paged TFLOP/s  SDPA TFLOP/s  paged/SDPA")
    for r in report.prefill:
        print(f"        {r['tokens']:6d}  {r['paged_tflops']:12.2f}  {r['sdpa_tflops']:12.2f}"
              f"  {r['paged_vs_sdpa']:.2f}")  # fmt: skip
    for s in report.skipped:
        print(f"skipped (memory): {s}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes; runs on CPU too")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--memory-fraction", type=float, default=0.5,
                        help="share of free GPU memory one decode point may use")  # fmt: skip
    args = parser.parse_args(argv)

    has_gpu = os.path.exists("/dev/nvidia0")
    if not has_gpu and not args.smoke:
        msg = "skipped: no CUDA device (run on a GPU machine, or --smoke for the interpreter)"
        print(json.dumps({"skipped": msg}) if args.json else msg)
        return 0
    if not has_gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
    import torch

    if args.smoke and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        print("skipped: no CUDA and triton already imported without TRITON_INTERPRET=1")
        return 0
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sizes = SMOKE if args.smoke else FULL
    dtype = getattr(torch, args.dtype) if device.type == "cuda" else torch.float32
    timer = _timer(torch, device)
    budget = 1 << 30
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * args.memory_fraction / 2)  # the pool plus headroom
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    report = Report(device=name, dtype=str(dtype).removeprefix("torch."))
    torch.manual_seed(0)
    report.copy_gbps = bench_copy(torch, sizes, dtype, device, timer)
    bench_decode(torch, sizes, dtype, device, timer, budget, report)
    for n in sizes.prefill_lens:
        report.prefill.append(prefill_point(torch, sizes, n, dtype, device, timer))
    if args.json:
        print(json.dumps({**asdict(report), "sizes": asdict(sizes)}))
    else:
        _print_human(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
