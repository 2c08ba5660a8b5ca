"""Corruption check: greedy outputs through PD must equal a colocated reference token for token.

A KV page that arrives wrong (stale write, torn transfer, wrong page index) changes what decode
computes; greedy decoding turns that into different tokens. The check sends the same greedy
requests (prompts long enough for several prefill chunks) to the PD deployment and to a
colocated reference — another server (`reference_url`) or an in-process colocated `Engine` —
and compares `output_ids`. It also reports the workers' `checksum_failures_total` delta.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from typing import Any

import anyio
import httpx

from pdengine.server.diagnostics_scrape import DiagnosticsError, discover_workers, scrape_all
from pdengine.types import SamplingParams


@dataclass(frozen=True)
class CorruptionConfig:
    url: str
    requests: int = 16
    reference_url: str | None = None
    model: str | None = None  # in-process reference model; default: what the server serves
    min_prompt_tokens: int = 64
    max_prompt_tokens: int = 1024
    max_tokens: int = 16
    concurrency: int = 8
    seed: int = 0
    timeout_s: float = 120.0


@dataclass
class CorruptionResult:
    requests: int = 0
    compared: int = 0
    mismatches: int = 0
    errors: int = 0
    checksum_failures: int = 0
    reference: str = ""
    first_error: str = ""
    first_mismatch: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.mismatches == 0 and self.errors == 0 and self.checksum_failures == 0

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def _prompts(cfg: CorruptionConfig) -> list[list[int]]:
    rng = random.Random(cfg.seed)
    return [
        [rng.randrange(32, 127) for _ in range(rng.randint(cfg.min_prompt_tokens, cfg.max_prompt_tokens))]
        for _ in range(cfg.requests)
    ]


async def _generate_http(client: httpx.AsyncClient, url: str, prompt: list[int], n: int) -> list[int]:
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True},
    }
    resp = await client.post(f"{url}/generate", json=body)
    if resp.status_code != 200:
        raise DiagnosticsError(f"{url}/generate answered {resp.status_code}: {resp.text[:200]}")
    return [int(t) for t in resp.json()["output_ids"]]


def _checksum_failures(url: str) -> int:
    with httpx.Client(timeout=10.0, trust_env=False) as client:
        scrapes = scrape_all(client, discover_workers(client, url))
    return int(sum(s.total("checksum_failures_total") for s in scrapes))


def _served_model(url: str) -> str:
    with httpx.Client(timeout=10.0, trust_env=False) as client:
        resp = client.get(f"{url}/v1/models")
        resp.raise_for_status()
        return str(resp.json()["data"][0]["id"])


async def _run_all(cfg: CorruptionConfig, prompts: list[list[int]], fn: Any) -> list[Any]:
    """fn(prompt) for every prompt, `cfg.concurrency` at a time; exceptions are kept."""
    out: list[Any] = [None] * len(prompts)
    limiter = anyio.CapacityLimiter(cfg.concurrency)

    async def one(i: int) -> None:
        async with limiter:
            try:
                out[i] = await fn(prompts[i])
            except (DiagnosticsError, httpx.HTTPError, KeyError, ValueError) as exc:
                out[i] = exc

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return out


async def _reference_outputs(cfg: CorruptionConfig, prompts: list[list[int]]) -> tuple[str, list]:
    if cfg.reference_url:
        async with httpx.AsyncClient(timeout=cfg.timeout_s, trust_env=False) as client:
            outs = await _run_all(
                cfg, prompts, lambda p: _generate_http(client, cfg.reference_url, p, cfg.max_tokens)
            )
        return cfg.reference_url, outs
    import torch

    from pdengine.engine import Engine  # the in-process reference is only loaded when used

    # The reference only has to be right, and the deployment under test shares this machine:
    # one thread, instead of a thread pool fighting the workers for the cores.
    torch.set_num_threads(1)
    model = cfg.model or await anyio.to_thread.run_sync(_served_model, cfg.url)
    params = SamplingParams(max_tokens=cfg.max_tokens, temperature=0.0, ignore_eos=True)
    async with Engine(model=model, mode="colocated") as engine:

        async def gen(prompt: list[int]) -> list[int]:
            return list((await engine.generate(prompt_token_ids=prompt, params=params)).token_ids)

        outs = await _run_all(cfg, prompts, gen)
    return f"in-process colocated Engine({model!r})", outs


async def run_corruption(cfg: CorruptionConfig) -> CorruptionResult:
    prompts = _prompts(cfg)
    failures_before = await anyio.to_thread.run_sync(_checksum_failures, cfg.url)
    async with httpx.AsyncClient(timeout=cfg.timeout_s, trust_env=False) as client:
        pd_outs = await _run_all(
            cfg, prompts, lambda p: _generate_http(client, cfg.url, p, cfg.max_tokens)
        )
    failures_after = await anyio.to_thread.run_sync(_checksum_failures, cfg.url)
    reference, ref_outs = await _reference_outputs(cfg, prompts)
    result = CorruptionResult(
        requests=len(prompts),
        reference=reference,
        checksum_failures=failures_after - failures_before,
    )
    for i, (pd, ref) in enumerate(zip(pd_outs, ref_outs, strict=True)):
        if isinstance(pd, Exception) or isinstance(ref, Exception):
            result.errors += 1
            result.first_error = result.first_error or str(pd if isinstance(pd, Exception) else ref)
            continue
        result.compared += 1
        if pd != ref:
            result.mismatches += 1
            if not result.first_mismatch:
                at = next((k for k, (a, b) in enumerate(zip(pd, ref, strict=False)) if a != b),
                          min(len(pd), len(ref)))
                result.first_mismatch = {
                    "request": i,
                    "prompt_tokens": len(prompts[i]),
                    "first_differing_token": at,
                    "pd": pd,
                    "reference": ref,
                }
    return result
