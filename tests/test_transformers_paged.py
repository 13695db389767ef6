"""``"gstar"`` inside transformers' continuous batching (``model.generate_batch``).

A model on ``"gstar"`` runs continuous batching on gstar's paged name (``integration.PAGED``): the requests of a
step packed in one row, some prefilling, some decoding one token, each against the keys transformers' paged cache
gathers for it (``cu_seq_lens_k`` by layer type: the sliding layers keep only their window), through
:func:`gstar.flash_attention_varlen`. Tiny float32 twins with the same weights give the reference's greedy tokens
and log-probabilities: SDPA's for Llama, paged eager attention's for GPT-OSS (sliding and full layers, learned
sinks; transformers runs no SDPA for it). With the decode fast path switched on (transformers enables it for
flash-attn 2 / 3 on CUDA only), decode steps append into the paged cache through
:func:`gstar.flash_attention_with_kvcache` on transformers' block table. What gstar cannot take raises.
"""

import copy

import pytest
import torch

import gstar

transformers = pytest.importorskip("transformers")
initialization = pytest.importorskip("transformers.generation.continuous_batching.initialization")
integration = pytest.importorskip("gstar.integrations.transformers")  # registers "gstar"

VOCAB, NEW = 64, 5
# lengths 3, 10, 1 and 20: 34 prompt tokens over batches of 32, so that prefill chunks and decode steps share steps
PROMPTS = [[1, 2, 3], list(range(4, 14)), [14], list(range(20, 40))]
_SMALL = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


def _llama():
    return transformers.LlamaConfig(**_SMALL)


def _gpt_oss():
    return transformers.GptOssConfig(**_SMALL, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                                     num_local_experts=2, num_experts_per_tok=1, max_position_embeddings=512)


def _twins(config, reference):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="gstar").eval()
    with torch.no_grad():
        for layer in model.model.layers:
            if getattr(layer.self_attn, "sinks", None) is not None:
                layer.self_attn.sinks.normal_()  # learned sinks that matter (they start at zero)
    twin = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=reference).eval()
    twin.load_state_dict(model.state_dict())
    return model, twin


def _generate(model, prompts=PROMPTS, **cb):
    generation = transformers.GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=-1, pad_token_id=0)
    small = {"page_size": 16, "num_blocks": 16, "max_batch_tokens": 32, "use_cuda_graph": False,
             "return_logprobs": True}
    cb = transformers.ContinuousBatchingConfig(**{**small, **cb})
    out = model.generate_batch(prompts, generation_config=generation, continuous_batching_config=cb)
    results = [out[f"req_{i}"] for i in range(len(prompts))]
    assert all(r.error is None for r in results), [r.error for r in results]
    return [r.generated_tokens for r in results], torch.tensor([r.logprobs for r in results])


class _Spy:
    """Records the calls of one of the integration's gstar entry points (tensor arguments as they are then: the
    continuous batching lengths are views of buffers the next step overwrites)."""

    def __init__(self, monkeypatch, name):
        self.calls, fn = [], getattr(integration, name)

        def spy(*args, **kwargs):
            self.calls.append((tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args), kwargs))
            return fn(*args, **kwargs)
        monkeypatch.setattr(integration, name, spy)


@pytest.mark.parametrize("model_name, reference", [("llama", "sdpa"), ("gpt_oss", "eager")])
def test_generate_batch_matches_reference(monkeypatch, model_name, reference):
    config = {"llama": _llama, "gpt_oss": _gpt_oss}[model_name]()
    model, twin = _twins(config, reference)
    varlen = _Spy(monkeypatch, "flash_attention_varlen")
    tokens, logprobs = _generate(model)
    ref_tokens, ref_logprobs = _generate(twin)
    assert tokens == ref_tokens
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-4, rtol=1e-4)
    assert model.config._attn_implementation == integration.NAME  # the model's own name once the batch is done

    # gstar ran every step: packed requests, prefill and decode in one step, by layer type
    assert varlen.calls
    lengths = [((a[3][1:] - a[3][:-1]).tolist(), (a[4][1:] - a[4][:-1]).tolist()) for a, _ in varlen.calls]
    assert any(1 in q and max(q) > 1 for q, _ in lengths), "no step mixed prefill and decode"
    if model_name == "gpt_oss":
        windows = {kw["window"] for _, kw in varlen.calls}
        assert windows == {(3, 0), (-1, -1)}
        assert all(kw["sinks"] is not None for _, kw in varlen.calls)
        # the sliding layers' keys: at most the window's 3 earlier keys beside each step's queries
        assert any(max(k[i] - q[i] for i in range(len(q))) > 3 for q, k in lengths)


def test_generate_batch_decode_fast_path(monkeypatch):
    # transformers passes a block table only to flash-attn 2 / 3 on CUDA; switched on here, decode-only steps hand
    # gstar the paged cache, the new tokens to append and the block table
    monkeypatch.setattr(initialization, "ensure_decode_fast_path_is_available", lambda *args, **kwargs: None)
    model, twin = _twins(_llama(), "sdpa")
    kvcache = _Spy(monkeypatch, "flash_attention_with_kvcache")
    tokens, logprobs = _generate(model, max_blocks_per_request=4)
    assert kvcache.calls, "no decode step took the block table"
    q, k_cache = kvcache.calls[0][0][:2]
    assert q.shape[2] == 1 and k_cache.shape[1:] == (16, 2, 16)  # (pages, page_size, kv heads, head dim)
    ref_tokens, ref_logprobs = _generate(twin, max_blocks_per_request=0)  # SDPA takes no block table
    assert tokens == ref_tokens
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-4, rtol=1e-4)


class _Layer(torch.nn.Module):
    def __init__(self, layer_types=("sliding_attention", "full_attention"), layer_idx=0):
        super().__init__()
        self.config = transformers.PretrainedConfig(layer_types=list(layer_types))
        self.layer_idx, self.is_causal = layer_idx, True


def _paged_step(page_size=16, lengths=(5, 17, 1), Hq=4, Hkv=2, D=16, pages=8):
    """One decode step as transformers hands it: a token per sequence, the paged cache holding the earlier keys."""
    torch.manual_seed(1)
    B = len(lengths)
    k_cache, v_cache = torch.randn(2, pages, page_size, Hkv, D)
    block_table = torch.randperm(pages, dtype=torch.int32)[:B * 2].view(B, 2)
    cu_k = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    query, key, value = torch.randn(1, Hq, B, D), torch.randn(1, Hkv, B, D), torch.randn(1, Hkv, B, D)
    return {"query": query, "key": key, "value": value, "k_cache": k_cache, "v_cache": v_cache,
            "block_table": block_table, "cu_seq_lens_k": cu_k}


def test_paged_decode_step_matches_varlen():
    # GPT-OSS's sliding layer: window and learned sinks through the block-table path, against the keys gathered
    step, sinks = _paged_step(), torch.randn(4)
    k_cache, v_cache = step["k_cache"].clone(), step["v_cache"].clone()
    lengths = (step["cu_seq_lens_k"][1:] - step["cu_seq_lens_k"][:-1]).tolist()
    with torch.no_grad():
        out, _ = integration.gstar_attention_forward(
            _Layer(), step["query"], step["key"], step["value"], None, sliding_window=4, s_aux=sinks, is_causal=True,
            k_cache=step["k_cache"], v_cache=step["v_cache"], block_table=step["block_table"],
            cu_seq_lens_q=torch.arange(len(lengths) + 1, dtype=torch.int32), max_length_q=1,
            cu_seq_lens_k={"sliding_attention": step["cu_seq_lens_k"], "full_attention": None},
            max_length_k={"sliding_attention": 1, "full_attention": 1})
    keys, values = [], []
    for b, n in enumerate(lengths):  # the earlier keys from the pages, then the new one
        rows = torch.cat([k_cache[p] for p in step["block_table"][b]])[:n - 1], step["key"][0, :, b][None]
        keys.append(torch.cat(rows))
        rows = torch.cat([v_cache[p] for p in step["block_table"][b]])[:n - 1], step["value"][0, :, b][None]
        values.append(torch.cat(rows))
    ref = gstar.flash_attention_varlen(step["query"][0].transpose(0, 1), torch.cat(keys), torch.cat(values),
                                       torch.arange(len(lengths) + 1, dtype=torch.int32), step["cu_seq_lens_k"],
                                       1, max(lengths), causal=True, window=(3, 0), sinks=sinks)
    assert out.shape == (1, len(lengths), 4, 16)
    torch.testing.assert_close(out[0], ref, atol=1e-5, rtol=1e-5)
    # the new tokens were appended where each sequence's keys end
    for b, n in enumerate(lengths):
        page, slot = step["block_table"][b, (n - 1) // 16], (n - 1) % 16
        torch.testing.assert_close(step["k_cache"][page, slot], step["key"][0, :, b])


class _CacheWrittenByAttention:
    """A paged cache that leaves its writing to the attention function, as transformers 5.17 and older have it:
    ``update`` takes the layer's read and write indices, writes the new rows and returns the rows read."""

    def __init__(self, rows):
        self.keys, self.values = rows                                              # (slots, Hkv, D)

    def update(self, key_states, value_states, layer_idx, read_index, write_index):
        self.keys.index_copy_(0, write_index[layer_idx], key_states[0].transpose(0, 1))
        self.values.index_copy_(0, write_index[layer_idx], value_states[0].transpose(0, 1))
        return self.keys[read_index[layer_idx]], self.values[read_index[layer_idx]]


def test_cache_written_by_the_attention_function():
    # a chunk of 2 queries after 3 cached keys and a 4-query prefill, as such a release hands them over
    torch.manual_seed(2)
    Hq, Hkv, D = 4, 2, 16
    cache = _CacheWrittenByAttention(torch.randn(2, 12, Hkv, D))
    past = cache.keys[[7, 2, 9]].clone(), cache.values[[7, 2, 9]].clone()
    query, key, value = torch.randn(1, Hq, 6, D), torch.randn(1, Hkv, 6, D), torch.randn(1, Hkv, 6, D)
    write, read = torch.tensor([4, 0, 11, 5, 6, 8]), torch.tensor([7, 2, 9, 4, 0, 11, 5, 6, 8])
    cu_q, cu_k = torch.tensor([0, 2, 6], dtype=torch.int32), torch.tensor([0, 5, 9], dtype=torch.int32)
    with torch.no_grad():
        out, _ = integration.gstar_attention_forward(
            _Layer(layer_idx=0), query, key, value, None, cache=cache, read_index=[read], write_index=[write],
            cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k, max_seqlen_q=4, max_seqlen_k=5)
    new_k, new_v = key[0].transpose(0, 1), value[0].transpose(0, 1)                # (6, Hkv, D)
    keys = torch.cat([past[0], new_k])                                             # (9, Hkv, D)
    values = torch.cat([past[1], new_v])
    ref = gstar.flash_attention_varlen(query[0].transpose(0, 1), keys, values, cu_q, cu_k, 4, 5, causal=True)
    torch.testing.assert_close(out[0], ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache.keys[write], new_k)  # the new rows were written


def test_paged_errors():
    step = _paged_step(page_size=8)
    with pytest.raises(ValueError, match="multiple of 16"), torch.no_grad():
        integration.gstar_attention_forward(_Layer(), step.pop("query"), step.pop("key"), step.pop("value"), None,
                                            **step)
    q, k = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 3, 16)
    with pytest.raises(ValueError, match="none of them this layer's"):
        integration.gstar_attention_forward(
            _Layer(layer_idx=1), q, k, k, None, cu_seq_lens_q=torch.tensor([0, 3], dtype=torch.int32),
            cu_seq_lens_k={"sliding_attention": torch.tensor([0, 3], dtype=torch.int32), "chunked_attention": None},
            max_length_q=3, max_length_k={"sliding_attention": 3, "chunked_attention": 3})
    with pytest.raises(ValueError, match="together"):
        integration.gstar_attention_forward(_Layer(), q, k, k, None, block_table=torch.zeros(3, 1, dtype=torch.int32))
