"""The decode suite's latent rows (DeepSeek-V3's multi-head latent attention decoded with absorbed weights): their
shapes against DeepseekV3Config, one paged cache whose first 512 lanes are the values (views, read once in the
memory floor), the oracle in pieces of query heads, a shrunk case run through the bench on a CPU (the PyTorch path
and the Triton kernel under the interpreter) against the oracle, and every peer that cannot run it saying why."""

import dataclasses

import pytest
import torch

from gstar import naive_attention
from gstar.kvcache import flash_attention_with_kvcache
from gstar.lab.bench import measure
from gstar.lab.bench.cases import DECODE_PAGE, Case, cache_lengths, for_cpu, suite
from gstar.lab.bench.peers import FA4, FlashInfer, Gstar, Peer, all_peers
from gstar.lab.bench.runner import run_row

CPU = torch.device("cpu")
LATENT = [c for c in suite("decode") if c.latent]


@pytest.fixture(autouse=True)
def _few_timed_runs(monkeypatch):
    monkeypatch.setattr(measure, "CPU_BUDGET_S", 0.0)  # the fewest timed runs: these tests check, not time


def test_latent_rows_follow_deepseek_v3():
    """128 query heads on one latent kv head of kv_lora_rank + qk_rope_head_dim = 576 lanes, values its first
    kv_lora_rank = 512, bf16, causal, one query, pages of DECODE_PAGE keys: one long cache, 8 long ones, 64 of
    random lengths up to 32768 (the GPT-OSS-20B step's draws), after the GPT-OSS rows."""
    assert [(c.batch, c.seqlen, c.lengths) for c in LATENT] == [(1, 131072, ()), (8, 32768, ()),
                                                              (64, 32768, cache_lengths(64, 32768))]
    assert {(c.heads, c.kv_heads, c.head_dim, c.dv, c.dtype, c.causal, c.window, c.queries, c.page_size, c.sinks)
            for c in LATENT} == {(128, 1, 576, 512, "bfloat16", True, (-1, -1), 1, DECODE_PAGE, False)}
    assert suite("decode")[-len(LATENT):] == LATENT and max(LATENT[2].lengths) <= 32768 < sum(LATENT[2].lengths)
    assert all("D576/512 latent" in c.label for c in LATENT)
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, "DeepseekV3Config", None)
    if config is None:
        pytest.skip("transformers without DeepSeek-V3")
    cfg = config()
    if any(getattr(cfg, n, None) is None for n in ("num_attention_heads", "kv_lora_rank", "qk_rope_head_dim")):
        pytest.skip("DeepseekV3Config without the latent attention's fields")
    assert {(c.heads, c.head_dim, c.dv) for c in LATENT} == \
        {(cfg.num_attention_heads, cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.kv_lora_rank)}


def test_latent_floor_reads_the_cache_once():
    """bytes_moved of a latent step: each key's 576 lanes once (the values are 512 of them), the queries, the
    outputs and the LSE; FLOPs over both products; the floor at 4.8 TB/s."""
    per_sequence = 2 * 128 * 576 + 2 * 128 * 512 + 4 * 128  # q and out in bf16, lse in float32
    for c in LATENT:
        keys = sum(c.lengths) if c.lengths else c.batch * c.seqlen  # full causal: the whole of every cache
        assert c.bytes_moved("fwd") == 2 * 576 * keys + c.batch * per_sequence
        twin = dataclasses.replace(c, latent=False)  # values a cache of their own: 512 lanes more a key
        assert twin.bytes_moved("fwd") - c.bytes_moved("fwd") == 2 * 512 * keys
        assert c.flops("fwd") == 2 * 128 * (576 + 512) * keys
    assert LATENT[0].bytes_moved("fwd") / 4.8e9 == pytest.approx(0.0315, rel=0.01)  # ms at 4.8 TB/s
    assert LATENT[1].bytes_moved("fwd") / 4.8e9 == pytest.approx(0.0634, rel=0.01)


def test_a_latent_case_is_a_decode_case():
    with pytest.raises(ValueError, match="latent cache"):
        Case("t", 1, 8, 1, 64, 32, value_dim=16, causal=True, latent=True)  # no queries: self-attention
    with pytest.raises(ValueError, match="latent cache"):
        Case("t", 1, 8, 1, 64, 32, value_dim=48, causal=True, queries=1, latent=True)  # values wider than keys
    with pytest.raises(ValueError, match="latent cache"):
        Case("t", 1, 8, 1, 64, 32, value_dim=16, causal=True, queries=1, latent=True, dtype="fp8")
    assert Case.from_dict(LATENT[0].as_dict()) == LATENT[0]
    small = for_cpu(LATENT[2])
    assert small.latent and (small.heads, small.kv_heads, small.head_dim, small.dv) == (16, 1, 576, 512)


def _small(case: Case, dtype: str) -> Case:
    """A latent row shrunk for the interpreter: 3 caches (unequal lengths where the row has them), 4 query heads,
    D 576 / Dv 512 kept."""
    lengths = (130, 70, 1) if case.lengths else ()
    return dataclasses.replace(case, batch=3, seqlen=130, heads=4, lengths=lengths, dtype=dtype)


def test_latent_inputs_are_views_of_one_cache():
    case = _small(LATENT[0], "float32")
    inputs = measure.make_inputs(case, CPU)
    k, v, pool, values = inputs["k"], inputs["v"], inputs["k_pages"], inputs["v_pages"]
    assert v.shape == (3, 1, 130, 512) and values.shape == (pool.shape[0], DECODE_PAGE, 1, 512)
    for whole, part in ((k, v), (pool, values)):
        assert part.data_ptr() == whole.data_ptr() and part.stride() == whole.stride() and part.stride(-1) == 1
        assert torch.equal(part, whole[..., :512])
    assert measure.nbytes(pool, values) == measure.nbytes(pool) == pool.numel() * 4  # held memory counted once
    assert measure.nbytes(pool, values.clone()) == (pool.numel() + values.numel()) * 4


class _TritonKernel(Gstar):
    """gstar's decode kernel (the Triton backend: the interpreter on a CPU) on the case's paged cache."""

    name = "gstar-triton"

    def build(self, case, device):
        lengths, table = case.cache_seqlens(device), case.block_table(device)
        return lambda q, k, v, sinks: flash_attention_with_kvcache(q, k, v, cache_seqlens=lengths, block_table=table,
                                                                   causal=case.causal, backend="triton")


class _LastLanes(Peer):
    """Wrong on purpose: takes the values from the keys' last 512 lanes instead of their first."""

    name = "last-lanes"

    def build(self, case, device):
        lengths, table = case.cache_seqlens(device), case.block_table(device)
        return lambda q, k, v, sinks: flash_attention_with_kvcache(q, k, k[..., -case.dv:], cache_seqlens=lengths,
                                                                   block_table=table, causal=case.causal)


# bfloat16 stays out: the Triton interpreter of triton 3.6 computes bfloat16 wrongly on CPU tensors at any shape
# (its NumPy arrays have no bfloat16); float16 is the 16-bit case here, bfloat16 runs on a GPU
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("row", [0, 2], ids=["equal-lengths", "unequal-lengths"])
def test_latent_rows_check_against_the_oracle(row, dtype):
    """gstar (the PyTorch path and the Triton kernel) on the views within the bar of docs/design.md section 4;
    values from the wrong lanes miss it; every other peer n/a with its reason, none an error."""
    case = _small(LATENT[row], dtype)
    inputs = measure.make_inputs(case, CPU)
    ref, pt = measure.references(case, inputs, grads=False)
    want = torch.cat([naive_attention(inputs["q"][b:b + 1].double(), inputs["k"][b:b + 1, :, :n].double(),
                                      inputs["k"][b:b + 1, :, :n, :512].double(), causal=True)[0]
                      for b, n in enumerate(case.cache_seqlens(CPU).tolist())])
    torch.testing.assert_close(ref["out"], want, rtol=1e-12, atol=1e-12)  # the oracle's values: the first lanes
    rows = {p.name: run_row(p, case, "fwd", inputs, ref, pt, CPU)
            for p in all_peers() + [_TritonKernel(), _LastLanes()] if p.applies(case)}
    for name in ("gstar", "gstar-triton"):
        assert rows[name]["status"] == "ok" and rows[name]["time_ms"] > 0, rows[name]
    assert rows["last-lanes"]["status"] == "WRONG", rows["last-lanes"]
    assert rows["gstar-prefill"]["reason"] == rows["eager"]["reason"] == "no paged cache"
    others = [r for name, r in rows.items() if name not in ("gstar", "gstar-triton", "last-lanes")]
    assert others and all(r["status"] == "n/a" and r["reason"] for r in others), others


def _fa4(q, k, v, softmax_scale=None, causal=False, window_size=(None, None), learnable_sink=None, softcap=0.0,
         num_splits=1, pack_gqa=None, seqused_k=None, page_table=None, cu_seqlens_q=None, max_seqlen_q=None):
    """FA4's flash_attn_varlen_func as far as its signature goes (no flash_attn on a CPU)."""


def test_gpu_peers_say_why_they_cannot_run_a_latent_row(monkeypatch):
    """FA4 (its interface asserts head_dim <= 256) and FlashInfer (one head dim in its paged wrappers) are n/a
    with the reason, as they would be on a GPU, rather than failing in the timed call."""
    monkeypatch.setattr(FA4, "_entry", lambda self, case: _fa4)
    for c in LATENT:
        assert FA4().unsupported(c, CPU, "fwd") == "head dims up to 256"
        assert FlashInfer().unsupported(c, CPU, "fwd").startswith("values as wide as the keys only")
    wide = dataclasses.replace(LATENT[0], head_dim=256, value_dim=256, latent=False)
    assert FA4().unsupported(wide, CPU, "fwd") is None


def test_oracle_in_pieces_of_query_heads(monkeypatch):
    """A group whose copies of its kv head outgrow the oracle's budget is cut into pieces of its query heads;
    the pieces add up to one call exactly, gradients included."""
    seen = []

    def counted(q, k, v, **kw):
        seen.append(q.shape[1])
        return naive_attention(q, k, v, **kw)
    case = Case("t", 2, 8, 1, 50, 16, value_dim=8, causal=True, window=(20, 0), sinks=True, dtype="float32")
    inputs = measure.make_inputs(case, CPU)
    monkeypatch.setattr(measure, "naive_attention", counted)
    # 8 heads' float64 copies of the kv head (8 x 50 x 24 x 8 = 76,800 bytes) overflow 48,000: pieces of 3 rows
    # (score buffers of 50 x 32 bytes a row and head), and of 3 heads (3 x (9,600 + 3 x 1,600) bytes)
    monkeypatch.setattr(measure, "_budget", lambda device: 48000)
    monkeypatch.setattr(measure, "MIN_PIECE_ROWS", 1)
    got = measure.naive_reference(case, inputs, torch.float64, grads=True)
    assert max(seen) == 3 and set(seen) == {3, 2}  # pieces of 3, 3 and 2 heads
    leaves = [inputs[n].double().requires_grad_() for n in ("q", "k", "v", "sinks")]
    out, _ = naive_attention(*leaves[:3], sinks=leaves[3], causal=True, window=(20, 0))
    grads = torch.autograd.grad(out, leaves, inputs["dout"].double())
    for name, want in zip(("out", "dq", "dk", "dv", "dsinks"), (out,) + grads):
        torch.testing.assert_close(got[name], want.detach(), rtol=1e-12, atol=1e-12)
