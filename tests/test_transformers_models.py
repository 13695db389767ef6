"""Gemma 2, Gemma 3 and Llama 4 text models with the ``"gstar"`` attention implementation against ``"eager"``.

Each model's attention rules reach gstar: Gemma 2's logit soft-capping (``attn_logit_softcapping``, gstar's
``softcap``) and ``query_pre_attn_scalar`` scale, the sliding layers of Gemma 2 and 3, Llama 4's chunked layers
(``attention_chunk_size``, gstar's ``chunk``) beside its NoPE full layers with temperature tuning. Both
implementations run the same float32 weights (twins from a copy of one config) on the same batch, plain,
padded on either side and packed; logits at real tokens, the loss and every parameter gradient agree to
float32 rounding, and greedy generation from the dynamic and the static cache gives eager's tokens. The
plain batch first checks that the rule each model is here for (soft-capping, the window, the chunks) changes
eager's logits, so that agreeing means something. Gemma 3's bidirectional image tokens run as gstar's spans.
What gstar cannot express (other mask overlays, chunk boundaries a cache dropped) raises.
"""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
import gstar  # noqa: E402
import gstar.integrations.transformers as integration  # noqa: E402  (registers "gstar")
from gstar.lab.accuracy import relative_error  # noqa: E402
from gstar.reference import naive_attention  # noqa: E402
from test_transformers import (ATOL, N, VOCAB, _assert_same_grads, _grads, _padding_mask,  # noqa: E402
                               assert_training_step_matches, max_error, training_labels)

masking_utils = pytest.importorskip("transformers.masking_utils")

# every rule is narrower than N = 19 tokens: a sliding window of 5 keys, chunks of 4
WINDOW, CHUNK = 5, 4
_SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8)


def _gemma2(**overrides):
    # weights drawn wide enough (std 0.2) for scores of a few units, which a cap of 2 bends well into tanh;
    # query_pre_attn_scalar != head_dim: the scale is the model's, not D ** -0.5
    cfg = dict(_SMALL, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
               sliding_window=WINDOW, query_pre_attn_scalar=12, attn_logit_softcapping=2.0,
               final_logit_softcapping=30.0, initializer_range=0.2)
    return transformers.Gemma2Config(**{**cfg, **overrides})


def _gemma3(**overrides):
    cfg = dict(_SMALL, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
               sliding_window=WINDOW, query_pre_attn_scalar=12)
    return transformers.Gemma3TextConfig(**{**cfg, **overrides})


def _llama4(**overrides):
    # layer 0 chunked (RoPE, qk norm), layer 1 full (NoPE), its queries temperature-tuned from position 3 on
    cfg = dict(_SMALL, intermediate_size_mlp=16, num_hidden_layers=2, num_local_experts=2, num_experts_per_tok=1,
               attention_chunk_size=CHUNK, no_rope_layers=[1, 0], floor_scale=4)
    return transformers.Llama4TextConfig(**{**cfg, **overrides})


CONFIGS = {"gemma2": _gemma2, "gemma3": _gemma3, "llama4": _llama4}
# the config overrides that switch off the rule each model is here for
RULES = {"gemma2": dict(attn_logit_softcapping=None), "gemma3": dict(sliding_window=N + 8),
         "llama4": dict(attention_chunk_size=N + 8)}


def _pair(config, cls=None):
    """(eager model, gstar model) with identical float32 weights, from deep copies of one config."""
    def make(implementation):
        if cls is None:
            return transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                                                 attn_implementation=implementation)
        return cls._from_config(copy.deepcopy(config), attn_implementation=implementation)

    torch.manual_seed(0)
    eager, ours = make("eager"), make("gstar")
    ours.load_state_dict(eager.state_dict())
    assert ours.config._attn_implementation == "gstar" and eager.config._attn_implementation == "eager"
    return eager.float(), ours.float()


def _eager_twin(eager, config):
    """An eager model of ``config`` with ``eager``'s weights (a rule switched off)."""
    torch.manual_seed(0)
    other = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager")
    other.load_state_dict(eager.state_dict())
    return other.float()


def _assert_rule_matters(arch, eager, ids, **inputs):
    """The rule the model is here for changes eager's logits far beyond the tolerance."""
    off = _eager_twin(eager, CONFIGS[arch](**RULES[arch]))
    with torch.no_grad():
        assert max_error(off(input_ids=ids, **inputs).logits, eager(input_ids=ids, **inputs).logits) > 1000 * ATOL


@pytest.mark.parametrize("arch", sorted(CONFIGS))
@pytest.mark.parametrize("padding", [None, "right", "left"])
def test_batch_matches_eager(arch, padding):
    eager, ours = _pair(CONFIGS[arch]())
    ids = torch.randint(0, VOCAB, (3, N))
    mask = torch.ones_like(ids) if padding is None else _padding_mask([N, 11, 6], padding)
    if padding is None:
        _assert_rule_matters(arch, eager, ids)
    assert_training_step_matches(eager, ours, ids, mask)


@pytest.mark.parametrize("arch", sorted(CONFIGS))
@pytest.mark.parametrize("boundaries", ["position_ids", "cu_seq_lens"])
def test_packed_matches_eager(arch, boundaries):
    """One row of four documents (position ids restarting at 0; with cu_seq_lens as DataCollatorWithFlattening
    adds them): eager builds its per-document mask from the position ids, gstar attends document by document
    (windows and chunks counted from each document's start; Llama 4 does not forward the position ids to its
    attention, where the mask function's documents arrive instead). The last document alone gives the same logits
    (except in Llama 4, which tunes the temperature by the position in the row, not in the document)."""
    eager, ours = _pair(CONFIGS[arch]())
    lengths = [7, 1, 3, 8]  # a window of 5 and chunks of 4 cut two of them
    ids = torch.randint(0, VOCAB, (1, sum(lengths)))
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.masked_fill(position_ids == 0, -100)  # no target across a document boundary
    extra = {}
    if boundaries == "cu_seq_lens":
        cu = torch.tensor([0] + lengths).cumsum(0)
        extra = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths))
    # no cache, as in training: transformers looks for documents in the position ids only then
    outs = [eager(input_ids=ids, position_ids=position_ids, labels=labels, use_cache=False),
            ours(input_ids=ids, position_ids=position_ids, labels=labels, use_cache=False, **extra)]
    assert max_error(outs[1].logits, outs[0].logits) <= ATOL
    assert max_error(outs[1].loss, outs[0].loss) <= ATOL
    for out in outs:
        out.loss.backward()
    _assert_same_grads(eager, ours)
    if arch != "llama4":
        start = sum(lengths[:3])
        alone = eager(input_ids=ids[:, start:]).logits
        assert max_error(outs[1].logits[:, start:], alone) <= ATOL


# generation: a prompt of 4, then 6 tokens: the sliding layers' window (5) and Llama 4's chunk (4) are passed,
# the dynamic cache's chunked layer keeps only its last 3 keys, the static one rolls its 4-slot buffer
PROMPT, NEW = 4, 6


def _generate(model, ids, mask, cache):
    extra = dict(cache_implementation="static") if cache == "static" else {}
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True, **extra)
    return out.sequences, torch.stack(out.logits, dim=1)


GENERATE_CASES = [(arch, cache, padding) for arch in sorted(CONFIGS) for cache in ("dynamic", "static")
                  for padding in ("none", "left")]


@pytest.mark.parametrize("arch, cache, padding", GENERATE_CASES)
def test_greedy_generation_matches_eager(arch, cache, padding):
    eager, ours = _pair(CONFIGS[arch]())
    ids = torch.randint(1, VOCAB, (2, PROMPT))
    mask = torch.ones_like(ids)
    if padding == "left":
        mask[1, :PROMPT // 2] = 0
    tokens, logits = _generate(ours, ids, mask, cache)
    ref_tokens, ref_logits = _generate(eager, ids, mask, cache)
    torch.testing.assert_close(tokens, ref_tokens, rtol=0, atol=0)
    assert max_error(logits, ref_logits) <= ATOL


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_llama4_decoding_past_a_chunk_hides_the_keys_before_it(monkeypatch, cache):
    """Once a chunked layer's cache holds keys from position 1 on (the dynamic cache keeps the last 3 and the
    query's, the static one rolls a buffer of 4), the mask function hides those before the query's chunk: each
    row's keys then start at a chunk boundary, and every step's logits are eager's (the greedy test above)."""
    masks = []
    build = integration.gstar_mask

    def spy(**kwargs):
        out = build(**kwargs)
        if kwargs["kv_offset"]:
            masks.append((kwargs["q_offset"], kwargs["kv_offset"], out))
        return out

    monkeypatch.setitem(transformers.masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, "gstar", spy)
    _, ours = _pair(_llama4())
    _generate(ours, torch.randint(1, VOCAB, (2, PROMPT)), None, cache)
    # query at position p, keys p - 3 .. p: those before p's chunk start (p // 4 * 4) are hidden
    assert [q for q, _, _ in masks] == list(range(PROMPT, PROMPT + NEW - 1))
    for q, offset, mask in masks:
        hidden = q // CHUNK * CHUNK - offset
        if hidden == 0:
            assert mask is None
        else:
            assert mask.tolist() == [[False] * hidden + [True] * (CHUNK - hidden)] * 2


def test_gemma3_bidirectional_text_model_matches_eager():
    """``use_bidirectional_attention``: non-causal layers, full and windowed both ways (|i - j| < W); the model's
    mask overlays open exactly that, which gstar computes."""
    eager, ours = _pair(_gemma3(use_bidirectional_attention=True))
    ids = torch.randint(0, VOCAB, (3, N))
    mask = _padding_mask([N, 11, 6], "right")
    assert_training_step_matches(eager, ours, ids, mask)


def _gemma3_vision():
    """A tiny Gemma 3 with a SigLIP tower: an 8 x 8 image becomes 4 image tokens."""
    text = dict(_SMALL, vocab_size=VOCAB + 3, num_hidden_layers=2, sliding_window=WINDOW,
                layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=12)
    vision = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=8,
                  patch_size=2)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=VOCAB, boi_token_index=VOCAB + 1, eoi_token_index=VOCAB + 2)
    return _pair(config, transformers.Gemma3ForConditionalGeneration)


@pytest.mark.parametrize("padding", [None, "left", "right"])
def test_gemma3_image_tokens_match_eager(padding):
    """Gemma 3 lets image tokens see each other both ways: the blocks reach the mask function as
    ``block_sequence_ids`` (full layers) and as an ``or_mask_function`` (sliding layers, under their window),
    and become gstar's spans. Two images of 4 tokens each in a row of 14, plain and padded: logits at real
    tokens, the loss and every parameter gradient (SigLIP tower included) are eager's; so is a greedy
    continuation from the dynamic cache; the static cache's buffered prefill raises. Without image blocks
    (text-only token_type_ids, or none) the model matches eager too. The bidirectional blocks change eager's
    logits: agreeing means something."""
    eager, ours = _gemma3_vision()
    ids = torch.randint(3, VOCAB, (2, 14))
    ids[:, 2:6] = VOCAB   # the first image's 4 tokens
    ids[:, 8:12] = VOCAB  # the second's: a block of its own, 5 positions back (the sliding window)
    token_type_ids = (ids == VOCAB).long()
    pixels = torch.randn(4, 3, 8, 8)                   # two images per row
    mask = torch.ones_like(ids)
    if padding == "left":  # row 1 one token shorter, its tokens shifted right
        ids[1], token_type_ids[1] = ids[1].roll(1), token_type_ids[1].roll(1)
        ids[1, 0], token_type_ids[1, 0], mask[1, 0] = 3, 0, 0
    elif padding == "right":
        ids[1, -1], token_type_ids[1, -1], mask[1, -1] = 3, 0, 0
    inputs = dict(input_ids=ids, pixel_values=pixels, token_type_ids=token_type_ids, attention_mask=mask)
    labels = training_labels(ids, mask)
    outs = [m(**inputs, labels=labels) for m in (eager, ours)]
    real = mask.bool()
    with torch.no_grad():
        causal = eager(input_ids=ids, pixel_values=pixels, attention_mask=mask).logits  # no blocks
    assert max_error(causal[real], outs[0].logits[real]) > 1000 * ATOL
    assert max_error(outs[1].logits[real], outs[0].logits[real]) <= ATOL
    assert max_error(outs[1].loss, outs[0].loss) <= ATOL
    for out in outs:
        out.loss.backward()
    # the vision projector's gradients reach hundreds: float32 rounding, relative to their size
    g_eager, g_ours = _grads(eager), _grads(ours)
    assert g_eager.keys() == g_ours.keys() and g_eager
    for name, g in g_eager.items():
        assert relative_error(g_ours[name], g) <= 1e-5, name
    if padding != "right":  # generate continues left-padded rows only
        gen = [m.generate(**inputs, max_new_tokens=3, do_sample=False, pad_token_id=0) for m in (eager, ours)]
        torch.testing.assert_close(gen[1], gen[0], rtol=0, atol=0)
    with pytest.raises(ValueError, match="token blocks.*static cache"):
        ours.generate(**inputs, max_new_tokens=3, cache_implementation="static")
    text = ids[:, 7:]
    ref = eager(input_ids=text, token_type_ids=torch.zeros_like(text)).logits
    assert max_error(ours(input_ids=text, token_type_ids=torch.zeros_like(text)).logits, ref) <= ATOL
    # images without token_type_ids: causal over the image tokens, in both implementations
    ref = eager(input_ids=ids, pixel_values=pixels).logits
    assert max_error(ours(input_ids=ids, pixel_values=pixels).logits, ref) <= ATOL


def _mask_args(config, **extra):
    inputs_embeds = torch.zeros(2, 6, 4)
    return dict(config=config, inputs_embeds=inputs_embeds, attention_mask=None, cache=None, **extra)


def test_mask_overlays_gstar_cannot_express_raise():
    """Any or_mask_function / and_mask_function a model lays over its causal mask raises, in causal, sliding
    and chunked masks alike; blockwise overlays only where they hold a block."""
    config = _llama4()
    config._attn_implementation = "gstar"
    make = masking_utils.create_causal_mask
    everything = lambda b, h, q, kv: torch.tensor(True)  # noqa: E731
    with pytest.raises(ValueError, match="or_mask_function: opens keys"):
        make(**_mask_args(config, or_mask_function=everything))
    with pytest.raises(ValueError, match="and_mask_function: hides keys"):
        make(**_mask_args(config, and_mask_function=lambda b, h, q, kv: kv != 0))
    with pytest.raises(ValueError, match="or_mask_function"):
        masking_utils.create_chunked_causal_mask(**_mask_args(config, or_mask_function=everything))
    gemma = _gemma3()
    gemma._attn_implementation = "gstar"
    with pytest.raises(ValueError, match="and_mask_function"):
        masking_utils.create_sliding_window_causal_mask(**_mask_args(gemma, and_mask_function=lambda *a: True))
    blocks = torch.full((2, 6), -1)
    assert make(**_mask_args(config, block_sequence_ids=blocks)) is None  # no block: plain causal
    blocks[1, 2:4] = 0
    spans = make(**_mask_args(config, block_sequence_ids=blocks))  # a block: gstar's span ids, no padding
    assert isinstance(spans, integration._Spans) and spans.padding is None
    assert spans.ids.tolist() == [[0] * 6, [0, 0, 1, 1, 0, 0]]
    # the layer's own window, given as an and_mask_function (Gemma 3's sliding layers with images): accepted;
    # another window: raise
    assert make(**_mask_args(gemma, and_mask_function=masking_utils.sliding_window_overlay(WINDOW))) is None
    with pytest.raises(ValueError, match="sliding-window overlay of 3 keys"):
        make(**_mask_args(gemma, and_mask_function=masking_utils.sliding_window_overlay(3)))


def test_mask_overlays_raise_under_compile():
    """Compiled, the mask function cannot read closures: an overlay still raises (the tracing error wraps it);
    the plain causal mask traces."""
    config = _llama4()
    config._attn_implementation = "gstar"

    def build(embeds, **extra):
        return masking_utils.create_causal_mask(config=config, inputs_embeds=embeds, attention_mask=None, cache=None,
                                                **extra)

    embeds = torch.zeros(2, 6, 4)
    blocks = torch.full((2, 6), -1)
    blocks[1, 2:4] = 0
    for extra in (dict(block_sequence_ids=blocks), dict(or_mask_function=lambda b, h, q, kv: q >= 0)):
        torch._dynamo.reset()
        with pytest.raises(Exception, match="cannot read the mask overlay"):
            torch.compile(lambda e: build(e, **extra), fullgraph=True, backend="eager")(embeds)
    torch._dynamo.reset()
    assert torch.compile(build, fullgraph=True, backend="eager")(embeds) is None


def test_chunk_boundaries_gstar_cannot_place_raise():
    """A chunked layer's keys starting inside the queries' chunk (a cache that kept fewer than chunk - 1 keys):
    the chunk's first keys are gone and gstar cannot count its boundaries; raise rather than shift them."""
    function = masking_utils.chunked_causal_mask_function(CHUNK, torch.zeros(2, dtype=torch.long))
    common = dict(batch_size=2, q_length=1, mask_function=function, device="cpu")
    # query at position 6 (chunk 4..7); keys from position 4: kept, none hidden; from 5: raise
    assert integration.gstar_mask(kv_length=3, q_offset=6, kv_offset=4, **common) is None
    with pytest.raises(ValueError, match="chunk boundaries"):
        integration.gstar_mask(kv_length=2, q_offset=6, kv_offset=5, **common)
    # keys from position 3: the one before the chunk is hidden; a row left-padded by 1 has chunks from 1, 5, ..
    assert integration.gstar_mask(kv_length=4, q_offset=6, kv_offset=3, **common).tolist() == [[False] + [True] * 3] * 2
    padded = masking_utils.chunked_causal_mask_function(CHUNK, torch.tensor([0, 1]))
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, 0] = False
    out = integration.gstar_mask(kv_length=4, q_offset=6, kv_offset=3, attention_mask=mask,
                                 **dict(common, mask_function=padded))
    assert out.tolist() == [[False, True, True, True], [False, False, True, True]]


def _projections(B, Hq, Hkv, Nq, Nk, D):
    def make(H, n):
        return torch.randn(B, n, H, D, dtype=torch.float64).transpose(1, 2)
    return make(Hq, Nq), make(Hkv, Nk), make(Hkv, Nk)


class _Layer(torch.nn.Module):
    """An attention module as transformers hands it over: config (layer types, chunk size) and layer index."""

    def __init__(self, layer_types, layer_idx, chunk=None):
        super().__init__()
        self.config = transformers.PretrainedConfig()
        self.config.layer_types, self.config.attention_chunk_size = layer_types, chunk
        self.layer_idx = layer_idx


def test_attention_function_softcap_and_chunk_on_every_path():
    """softcap and chunk reach gstar on the plain, padded, packed and static-cache paths (float64 against the
    oracle); the chunk size comes from the module's layer type."""
    q, k, v = _projections(2, 4, 2, 11, 11, 8)
    chunked, full = _Layer(["chunked_attention", "full_attention"], 0, CHUNK), _Layer(["chunked_attention",
                                                                                      "full_attention"], 1, CHUNK)
    rule = dict(causal=True, chunk=CHUNK, softcap=0.7, scale=0.9)
    ref, _ = naive_attention(q, k, v, **rule)
    out, _ = integration.gstar_attention_forward(chunked, q, k, v, None, scaling=0.9, softcap=0.7)
    assert max_error(out, ref.transpose(1, 2)) <= 1e-12
    out, _ = integration.gstar_attention_forward(full, q, k, v, None, scaling=0.9, softcap=0.7)
    ref_full, _ = naive_attention(q, k, v, causal=True, softcap=0.7, scale=0.9)
    assert max_error(out, ref_full.transpose(1, 2)) <= 1e-12
    # padded: row 1's last 7 keys are real, chunks counted from its first
    mask = torch.ones(2, 11, dtype=torch.bool)
    mask[1, :4] = False
    out, _ = integration.gstar_attention_forward(chunked, q, k, v, mask, scaling=0.9, softcap=0.7)
    ref1, _ = naive_attention(q[1:, :, 4:], k[1:, :, 4:], v[1:, :, 4:], **rule)
    assert max_error(out[1, 4:], ref1[0].transpose(0, 1)) <= 1e-12
    # packed: documents of 6 and 5 in one row
    position_ids = torch.cat([torch.arange(6), torch.arange(5)])[None]
    out, _ = integration.gstar_attention_forward(chunked, q[:1], k[:1], v[:1], None, scaling=0.9, softcap=0.7,
                                                 position_ids=position_ids)
    for start, stop in ((0, 6), (6, 11)):
        ref_doc, _ = naive_attention(q[:1, :, start:stop], k[:1, :, start:stop], v[:1, :, start:stop], **rule)
        assert max_error(out[0, start:stop], ref_doc[0].transpose(0, 1)) <= 1e-12
    # static cache: 2 queries, 7 of 11 slots written
    filled = torch.tensor([7, 7], dtype=torch.int32)
    out, _ = integration.gstar_attention_forward(chunked, q[:, :, :2], k, v, filled, scaling=0.9, softcap=0.7)
    ref_c, _ = naive_attention(q[:, :, :2], k[:, :, :7], v[:, :, :7], **rule)
    assert max_error(out, ref_c.transpose(1, 2)) <= 1e-12


def test_context_parallel_takes_softcap_and_refuses_chunk(monkeypatch):
    """Inside context_parallel a soft-capped layer reaches context_parallel_attention with its cap; a chunked
    layer raises (context parallelism has no chunks)."""
    from gstar.distributed import context
    seen = {}

    def attend(q, k, v, **kw):
        seen.update(kw)
        return torch.zeros_like(q)

    monkeypatch.setattr(context, "context_parallel_attention", attend)
    q, k, v = _projections(1, 2, 2, 5, 5, 8)
    with gstar.distributed.context_parallel():
        integration.gstar_attention_forward(torch.nn.Module(), q, k, v, None, softcap=30.0)
        assert seen["softcap"] == 30.0
        with pytest.raises(ValueError, match="chunked attention"):
            integration.gstar_attention_forward(_Layer(["chunked_attention"], 0, CHUNK), q, k, v, None)
