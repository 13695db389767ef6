"""``model.generate`` with the ``"gstar"`` attention implementation against ``"eager"`` on tiny random models.

Greedy decoding from the dynamic cache (keys grow by concatenation; GPT-OSS's sliding layers keep only the
window's) and from the static cache (preallocated buffers with unwritten slots, decoded through
:func:`gstar.flash_attention_with_kvcache`), batches of two with and without left padding: the same tokens
as eager and every step's logits equal to float32 rounding.
"""

import pytest
import torch
from test_transformers import _COMPILABLE_EXPERTS, ATOL, VOCAB, _gpt_oss, _llama, _pair, max_error

import gstar.integrations.transformers as integration  # registers "gstar"

MODELS = {"gpt_oss": _gpt_oss, "llama": _llama}
# a prompt shorter than GPT-OSS's window of 5 keys: its static sliding layers decode from a partly written
# buffer, fill it, then roll it; the longer prompt fills the window during the prefill
PROMPT, NEW = 4, 6


def _generate(model, ids, mask, cache, new=NEW, **extra):
    """Greedy tokens (B, prompt + new) and each step's logits (B, new, V)."""
    if cache == "static":
        extra["cache_implementation"] = "static"
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True, **extra)
    return out.sequences, torch.stack(out.logits, dim=1)


def _assert_generation_matches(ours, eager, ids, mask, cache, **extra):
    tokens, logits = _generate(ours, ids, mask, cache, **extra)
    ref_tokens, ref_logits = _generate(eager, ids, mask, cache, **extra)
    torch.testing.assert_close(tokens, ref_tokens, rtol=0, atol=0)
    assert max_error(logits, ref_logits) <= ATOL


def _batch(prompt, padding):
    """Two prompts of ``prompt`` tokens; with left padding, row 1's first ``prompt // 2`` are padding."""
    ids = torch.randint(1, VOCAB, (2, prompt))
    mask = torch.ones_like(ids)
    if padding == "left":
        mask[1, :prompt // 2] = 0
    return ids, mask


# the padded path is the same for both caches and models: one of its cases runs in the full suite only
CASES = [(arch, cache, padding) for arch in sorted(MODELS) for cache in ("dynamic", "static")
         for padding in ("none", "left")]
CASES = [pytest.param(*case, marks=pytest.mark.slow) if case == ("llama", "dynamic", "left") else case
         for case in CASES]


@pytest.mark.parametrize("arch, cache, padding", CASES)
def test_greedy_generation_matches_eager(arch, cache, padding):
    eager, ours = _pair(MODELS[arch])
    _assert_generation_matches(ours, eager, *_batch(PROMPT, padding), cache)


@pytest.mark.parametrize("cache, padding", [("static", "none"),
                                            pytest.param("dynamic", "left", marks=pytest.mark.slow)])
def test_gpt_oss_prompt_longer_than_the_window(cache, padding):
    """The prefill fills GPT-OSS's window: a static sliding layer takes the prompt's keys whole, then rolls."""
    eager, ours = _pair(_gpt_oss)
    _assert_generation_matches(ours, eager, *_batch(9, padding), cache)


def test_static_cache_decodes_from_its_buffer_with_device_lengths(monkeypatch):
    """Without padding, every layer of every step attends through flash_attention_with_kvcache against the
    whole static buffer, its lengths growing by one a step, and nothing is unpadded."""
    calls = []
    attend = integration.flash_attention_with_kvcache

    def spy(q, k, v, **kwargs):
        calls.append((q.shape[2], k.shape[2], kwargs["cache_seqlens"].tolist()))
        return attend(q, k, v, **kwargs)

    def unpadded(*args, **kwargs):
        raise AssertionError("a batch without padding was unpadded")

    monkeypatch.setattr(integration, "flash_attention_with_kvcache", spy)
    monkeypatch.setattr(integration, "_padded", unpadded)
    _, ours = _pair(_llama)
    ids = torch.randint(1, VOCAB, (2, PROMPT))
    _generate(ours, ids, None, "static")
    layers, capacity = ours.config.num_hidden_layers, calls[0][1]
    # the prefill, then one token a step: the cache holds PROMPT + step keys once the step's are written
    want = [(PROMPT if step == 0 else 1, capacity, [PROMPT + step] * 2) for step in range(NEW) for _ in range(layers)]
    assert calls == want and capacity >= PROMPT + NEW - 1


def test_static_lengths_are_traced_from_the_cache_offset():
    """The mask function builds a static layer's lengths from the cache's offset tensor without reading it
    (torch.compile fullgraph: a host read raises), as a new tensor: the cache's in-place update of the offset
    during the forward pass leaves them unchanged."""
    offset = torch.tensor(7)  # a static layer's cumulative length before the step
    lengths = torch.compile(lambda off: integration.gstar_mask(batch_size=2, q_length=1, kv_length=16,
                                                               q_offset=off, device="cpu"),
                            fullgraph=True, backend="eager")(offset)
    offset.add_(1)
    assert lengths.dtype == torch.int32 and lengths.tolist() == [8, 8]
    # every key written: no lengths; lengths handed back by the model are passed through
    assert integration.gstar_mask(batch_size=2, q_length=1, kv_length=8, q_offset=7, device="cpu") is None
    assert integration.gstar_mask(batch_size=2, q_length=1, kv_length=16, attention_mask=lengths) is lengths


@pytest.mark.slow
def test_compiled_static_cache_generation_cpu():
    """generate's compiled decode step (Dynamo and AOTAutograd, as for Inductor) on the CPU: Llama rebuilds its
    mask inside the compiled forward from the lengths generate hands it. Same tokens and logits as eager."""
    from transformers import CompileConfig

    eager, ours = _pair(_llama)
    ids = torch.randint(1, VOCAB, (2, PROMPT))
    config = CompileConfig(backend="aot_eager", mode=None)
    config._compile_all_devices = True  # generate compiles on accelerators only unless told
    tokens, logits = _generate(ours, ids, None, "static", compile_config=config)
    assert hasattr(ours, "_compiled_call")
    ref_tokens, ref_logits = _generate(eager, ids, None, "static", disable_compile=True)
    torch.testing.assert_close(tokens, ref_tokens, rtol=0, atol=0)
    assert max_error(logits, ref_logits) <= ATOL


@pytest.mark.gpu
@pytest.mark.parametrize("arch", sorted(MODELS))
def test_compiled_static_cache_generation_cuda(arch):
    """The static cache under torch.compile on the GPU (generate compiles the decode step, CUDA graphs
    included): float32, the same tokens as uncompiled eager and every step's logits within 1e-4."""
    model_kwargs = _COMPILABLE_EXPERTS if arch == "gpt_oss" else None
    eager, ours = _pair(MODELS[arch], model_kwargs, hidden_size=128, num_attention_heads=8, head_dim=64)
    eager, ours = eager.to("cuda"), ours.to("cuda")
    ids = torch.randint(1, VOCAB, (2, 20), device="cuda")
    mask = torch.ones_like(ids)
    tokens, logits = _generate(ours, ids, mask, "static", new=40)
    assert hasattr(ours, "_compiled_call")  # generate compiled the decode step
    ref_tokens, ref_logits = _generate(eager, ids, mask, "static", new=40, disable_compile=True)
    torch.testing.assert_close(tokens, ref_tokens, rtol=0, atol=0)
    assert max_error(logits, ref_logits) <= 1e-4
