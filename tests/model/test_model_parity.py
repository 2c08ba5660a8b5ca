"""Logits parity with transformers over a real paged pool (shuffled pages, page_size 4)."""

from __future__ import annotations

import pytest
import torch
from model_paging import PagedRunner

from pdengine.model import Model
from pdengine.model.rope import Rotary

TOL = 1e-4
DECODE_STEPS = 8
PROMPTS = [[5, 17, 33, 2, 9], list(range(20, 31)), [7, 3, 150, 44, 61, 8, 99, 12, 13, 1, 140, 77,
                                                    6, 5, 4, 90, 91]]


@pytest.fixture(scope="module")
def hf_models(hf_checkpoints):
    import transformers

    return {name: transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            for name, path in hf_checkpoints.items()}


def reference(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(input_ids=torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_prefill_and_every_decode_step_match_transformers(arch, hf_checkpoints, hf_models):
    model = Model.load(hf_checkpoints[arch])
    runner = PagedRunner(model, page_size=4)
    seqs = {i: list(p) for i, p in enumerate(PROMPTS)}
    # Step 0 prefills all prompts in one batch; later steps decode one token per sequence.
    step_logits = [runner.step(dict(seqs))]
    for _ in range(DECODE_STEPS):
        nxt = step_logits[-1].argmax(-1).tolist()
        for i, tok in enumerate(nxt):
            seqs[i].append(tok)
        step_logits.append(runner.step({i: [tok] for i, tok in enumerate(nxt)}))
    worst = 0.0
    for i, prompt in enumerate(PROMPTS):
        ref = reference(hf_models[arch], seqs[i])
        for step, logits in enumerate(step_logits):
            pos = len(prompt) - 1 + step
            diff = (logits[i] - ref[pos]).abs().max().item()
            worst = max(worst, diff)
            assert diff <= TOL, f"{arch} seq {i} step {step}: max abs diff {diff}"
    assert ref.abs().max() > 1.0  # the comparison is not between near-zero logits
    print(f"{arch}: max abs diff {worst:.2e}")


def test_chunked_prefill_equals_one_shot(hf_checkpoints, hf_models):
    model = Model.load(hf_checkpoints["llama"])
    prompt = PROMPTS[2]
    one_shot = PagedRunner(model, seed=1).step({0: prompt})[0]
    chunked = PagedRunner(model, seed=2)
    ref = reference(hf_models["llama"], prompt)
    end = 0
    for size in (6, 7, 4):
        logits = chunked.step({0: prompt[end:end + size]})[0]
        end += size
        assert (logits - ref[end - 1]).abs().max() <= TOL
    assert torch.allclose(logits, one_shot, atol=TOL, rtol=0)


def test_mixed_batch_of_prefill_chunk_and_decode(hf_checkpoints, hf_models):
    """A decoding sequence and a prefilling one share one (non-decode) step."""
    model = Model.load(hf_checkpoints["qwen3"])
    runner = PagedRunner(model)
    a, b = PROMPTS[0], PROMPTS[2]
    runner.step({0: a, 1: b[:9]})
    logits = runner.step({0: [42], 1: b[9:]})
    assert (logits[0] - reference(hf_models["qwen3"], [*a, 42])[-1]).abs().max() <= TOL
    assert (logits[1] - reference(hf_models["qwen3"], b)[-1]).abs().max() <= TOL


def test_tied_embeddings_share_the_lm_head(hf_checkpoints):
    tied = Model.load(hf_checkpoints["qwen2"])
    untied = Model.load(hf_checkpoints["llama"])
    assert tied.config.tie_word_embeddings and tied.lm_head is tied.embed
    assert not untied.config.tie_word_embeddings
    assert not torch.equal(untied.lm_head, untied.embed)


def test_llama3_rope_scaling_is_applied(hf_checkpoints, hf_models):
    """Without the llama3 frequency scaling the same checkpoint would miss parity."""
    model = Model.load(hf_checkpoints["llama"])
    cfg = model.config
    assert cfg.rope_scaling is not None and cfg.rope_scaling.kind == "llama3"
    assert cfg.rope_theta == 500000.0
    ref = reference(hf_models["llama"], PROMPTS[2])[-1]
    assert (PagedRunner(model).step({0: PROMPTS[2]})[0] - ref).abs().max() <= TOL
    model.rotary = Rotary(cfg.head_dim, cfg.rope_theta, None)
    assert (PagedRunner(model).step({0: PROMPTS[2]})[0] - ref).abs().max() > 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_triton_path_matches_transformers(hf_checkpoints, hf_models):
    """On CUDA the kernels dispatch to Triton (fp32 dots may use TF32: looser tolerance)."""
    model = Model.load(hf_checkpoints["qwen3"], device="cuda")
    runner = PagedRunner(model)
    seqs = {i: list(p) for i, p in enumerate(PROMPTS)}
    logits = runner.step(dict(seqs))
    for _ in range(4):
        nxt = logits.argmax(-1).tolist()
        for i, tok in enumerate(nxt):
            seqs[i].append(tok)
        logits = runner.step({i: [tok] for i, tok in enumerate(nxt)})
    for i in seqs:
        ref = reference(hf_models["qwen3"], seqs[i])[-1]
        assert (logits[i] - ref).abs().max() <= 2e-2 * ref.abs().max()
