#!/usr/bin/env python3
"""Offline throughput: pdengine's colocated engine against transformers `generate`, same run.

A random Llama (8 layers, hidden 512, GQA 8/2 heads) is written to a temp dir
with `save_pretrained`; N requests with prompt lengths drawn from [32, 512]
and a fixed number of output tokens go through
- pdengine: all requests submitted at once (continuous batching, chunked prefill);
- transformers: `generate` on the same prompts, left-padded, in batches.
Both run greedy with eos ignored, so they produce the same number of tokens.
Also: the scheduler's own CPU cost per decode step (plan + batch tensors +
sample + update) with a no-op model at batch 1, 32 and 256.

    benchmarks/throughput.py [--requests 64] [--output-tokens 128] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import anyio
import torch

from pdengine.cache import KVPool
from pdengine.config import KVLayout, SchedulerConfig
from pdengine.engine import ColocatedEngine
from pdengine.model import ensure_tiny_checkpoint
from pdengine.runtime import ModelRunner, Scheduler, Sequence
from pdengine.types import SamplingParams

MODEL = dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=2, head_dim=64,
             max_position_embeddings=2048, rms_norm_eps=1e-5, bos_token_id=256, eos_token_id=257)


def make_checkpoint(directory: Path) -> Path:
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**MODEL)).eval()
    model.save_pretrained(directory)
    tiny = ensure_tiny_checkpoint()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, directory / name)
    return directory


def make_prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(300, MODEL["vocab_size"]) for _ in range(rng.randint(lo, hi))]
            for _ in range(n)]


async def run_pdengine(
    path: Path, prompts: list[list[int]], new_tokens: int
) -> tuple[float, float, int]:
    longest = max(map(len, prompts)) + new_tokens
    pages = sum(-(-(len(p) + new_tokens) // 16) for p in prompts) + 16
    cfg = SchedulerConfig(page_size=16, num_pages=pages, max_batch_size=len(prompts),
                          chunk_tokens=512, max_model_len=max(longest, 1024))
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    async with ColocatedEngine(str(path), scheduler_config=cfg) as engine:
        await engine.generate(prompt_token_ids=prompts[0][:8], params=SamplingParams(
            max_tokens=2, temperature=0.0))  # warm-up
        counts: list[int] = []

        async def one(p: list[int]) -> None:
            counts.append(len((await engine.generate(prompt_token_ids=p, params=params)).token_ids))

        t0, c0 = time.perf_counter(), time.process_time()
        async with anyio.create_task_group() as tg:
            for p in prompts:
                tg.start_soon(one, p)
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        assert engine.stats()["pages_used"] == 0
    return elapsed, cpu, sum(counts)


def run_hf(
    path: Path, prompts: list[list[int]], new_tokens: int, batch: int
) -> tuple[float, float, int]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cfg = transformers.GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                        do_sample=False, eos_token_id=None, pad_token_id=0)
    produced = 0
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            group = prompts[i : i + batch]
            width = max(map(len, group))
            ids = torch.zeros(len(group), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for r, p in enumerate(group):  # left padding
                ids[r, width - len(p) :] = torch.tensor(p)
                mask[r, width - len(p) :] = 1
            out = model.generate(ids, attention_mask=mask, generation_config=cfg)
            produced += (out.shape[1] - width) * len(group)
    return time.perf_counter() - t0, time.process_time() - c0, produced


class NoOpModel:
    """Returns zero logits: what is left to time is the runtime's own work."""

    def __init__(self, vocab: int = 256) -> None:
        self.vocab = vocab

    def forward(self, batch, kv_pool: torch.Tensor) -> torch.Tensor:
        return torch.zeros(batch.batch_size, self.vocab)


def scheduler_step_cost_us(batch: int, steps: int = 200) -> float:
    ps, ctx = 16, 64
    num_pages = batch * ((ctx + steps + 32) // ps + 2)
    cfg = SchedulerConfig(page_size=ps, num_pages=num_pages, max_batch_size=batch,
                          chunk_tokens=batch * ctx, max_model_len=4096)
    pool = KVPool(KVLayout(num_pages, 1, ps, 1, 1))
    sched = Scheduler(cfg, pool.allocator)
    runner = ModelRunner(NoOpModel(), pool)
    params = SamplingParams(max_tokens=steps + 10, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        sched.add(Sequence(str(i), [1] * ctx, params))

    def one_step() -> None:
        step = sched.schedule()
        tokens, logprobs = runner.step(step)
        sched.update(step, tokens, logprobs)

    one_step()  # the prefill
    for _ in range(5):
        one_step()
    t0 = time.process_time()  # CPU time: the runtime's cost, not the shared box's queueing
    for _ in range(steps):
        one_step()
    return (time.process_time() - t0) / steps * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--min-prompt", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--hf-batch", type=int, default=None, help="default: all requests at once")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads for both sides (on a shared 2-core box more "
                         "threads oversubscribe the cores and make both sides erratic)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    prompts = make_prompts(args.requests, args.min_prompt, args.max_prompt)
    with tempfile.TemporaryDirectory(prefix="pdengine-bench-") as tmp:
        path = make_checkpoint(Path(tmp))
        pd_s, pd_cpu, pd_tokens = anyio.run(run_pdengine, path, prompts, args.output_tokens)
        hf_s, hf_cpu, hf_tokens = run_hf(path, prompts, args.output_tokens,
                                         args.hf_batch or args.requests)
    step_cost = {str(b): round(scheduler_step_cost_us(b), 1) for b in (1, 32, 256)}
    result = {
        "requests": args.requests,
        "output_tokens": args.output_tokens,
        "prompt_tokens": sum(map(len, prompts)),
        "pdengine_s": round(pd_s, 2),
        "hf_s": round(hf_s, 2),
        "pdengine_tok_s": round(pd_tokens / pd_s, 1),
        "hf_tok_s": round(hf_tokens / hf_s, 1),
        "ratio": round((pd_tokens / pd_s) / (hf_tokens / hf_s), 2),
        # CPU seconds of this process: steadier than wall time on a machine shared with others.
        "pdengine_cpu_s": round(pd_cpu, 2),
        "hf_cpu_s": round(hf_cpu, 2),
        "cpu_ratio": round((pd_tokens / pd_cpu) / (hf_tokens / hf_cpu), 2),
        "scheduler_us_per_decode_step": step_cost,
        "torch_threads": torch.get_num_threads(),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{args.requests} requests, prompts {args.min_prompt}-{args.max_prompt} tokens "
              f"({result['prompt_tokens']} in all), {args.output_tokens} output tokens each")
        print(f"pdengine      {result['pdengine_tok_s']:>9.1f} output tok/s ({pd_s:.1f} s)")
        print(f"transformers  {result['hf_tok_s']:>9.1f} output tok/s ({hf_s:.1f} s)")
        print(f"ratio         {result['ratio']:>9.2f}x  (per CPU second: {result['cpu_ratio']:.2f}x,"
              f" {pd_cpu:.1f} vs {hf_cpu:.1f} CPU s)")
        for b, us in step_cost.items():
            print(f"scheduler CPU cost per decode step, no-op model, batch {b:>3}: {us:.1f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
