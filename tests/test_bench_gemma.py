"""``gstar bench --suite gemma`` and the mla suite's 4k and 8k rows: their shapes against the models' published
configurations (checked against transformers' config classes where transformers is importable), the suite in
``all`` and end to end at reduced shapes."""

import json

import pytest
import torch

from gstar.lab.bench import cases, measure
from gstar.lab.bench.cases import FORWARD_ONLY, Case, for_cpu, suite
from gstar.lab.cli.main import main

# The models' own numbers (their config.json files), where the config classes' defaults describe another size:
# Gemma2Config's defaults are Gemma 2 2B's heads, Gemma3TextConfig's Gemma 3 4B's.
GEMMA2_9B = dict(num_attention_heads=16, num_key_value_heads=8)
GEMMA3_12B = dict(num_attention_heads=16, num_key_value_heads=8, sliding_window=1024)
ROWS = [(2, 4096), (1, 8192)]  # 4k and 8k positions, 8192 tokens a batch


def _layer(config) -> dict:
    """A config's attention in the bench's terms: heads, kv heads, head dim, the sliding layers' window (HF's
    sliding_window = W keys, the query's own included: window (W - 1, 0)), and whether the scale is the default
    (Gemma scales scores by query_pre_attn_scalar ** -0.5)."""
    names = ("num_attention_heads", "num_key_value_heads", "head_dim", "sliding_window", "query_pre_attn_scalar")
    missing = [n for n in names if getattr(config, n, None) is None]
    if missing:
        pytest.skip(f"{type(config).__name__} has no {', '.join(missing)} in this transformers")
    return {"heads": config.num_attention_heads, "kv_heads": config.num_key_value_heads,
            "head_dim": config.head_dim, "window": (config.sliding_window - 1, 0),
            "default_scale": config.query_pre_attn_scalar == config.head_dim}


def _of(c: Case) -> dict:
    return {"heads": c.heads, "kv_heads": c.kv_heads, "head_dim": c.head_dim, "window": c.window,
            "default_scale": True}  # a Case has no scale of its own: every implementation takes D ** -0.5


def test_gemma_suite_shapes():
    """Gemma 2 9B's global (causal) and sliding (4095, 0) layers and Gemma 3 12B's sliding layer (1023, 0) at
    B2 N4096 and B1 N8192: 16 query heads, 8 kv heads, head dim 256, bfloat16, causal, nothing else; Gemma 2's
    window at 4096 positions hides no key, so its layer is the causal row there."""
    got = [(c.batch, c.seqlen, c.heads, c.kv_heads, c.head_dim, c.dv, c.dtype, c.causal, c.window) for c in
           suite("gemma")]
    assert got == [(b, n, 16, 8, 256, 256, "bfloat16", True, w) for b, n in ROWS
                   for w in ((-1, -1), (4095, 0), (1023, 0)) if w[0] < n - 1]
    assert all(b * n == 8192 for b, n, *_ in got)
    assert not any(c.softcap or c.sinks or c.sink_tokens or c.chunk or c.decode or c.lengths for c in suite("gemma"))
    assert "gemma" not in FORWARD_ONLY and set(suite("gemma")) & set(suite("all"))


def test_gemma_rows_follow_the_transformers_configs():
    """The rows' heads, head dim, scale and windows as transformers' Gemma2Config and Gemma3TextConfig give them
    (the models' head counts and Gemma 3 12B's window set as their config.json files do); Gemma 2's soft-cap,
    which this suite leaves to the models suite, and Gemma 3's lack of one."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Gemma3TextConfig"):
        pytest.skip("transformers without Gemma 3")
    gemma2 = transformers.Gemma2Config(**GEMMA2_9B)
    gemma3 = transformers.Gemma3TextConfig(**GEMMA3_12B)
    want2, want3 = _layer(gemma2), _layer(gemma3)
    rows = suite("gemma")
    # at 4096 positions Gemma 2's 4096-key window hides nothing: its causal row stands for it
    assert [_of(c) for c in rows] == [dict(want2, window=(-1, -1)), want3] \
        + [dict(want2, window=w) for w in ((-1, -1), want2["window"])] + [want3]
    assert want2["window"] == (4095, 0) and want3["window"] == (1023, 0)
    assert getattr(gemma2, "attn_logit_softcapping", None) == cases.GEMMA2_SOFTCAP == 50.0
    assert getattr(gemma3, "attn_logit_softcapping", "absent") is None
    models = [c for c in suite("models") if c.head_dim == 256]
    assert {c.softcap for c in models} == {50.0, 0.0} and {_of(c)["window"] for c in models} == {(-1, -1), (4095, 0)}


def test_mla_suite_at_4k_and_8k_follows_deepseek_v3():
    """DeepSeek-V3's training attention (transformers' DeepseekV3Config defaults): 128 heads, queries and keys of
    qk_nope_head_dim + qk_rope_head_dim = 192 lanes, values of v_head_dim = 128, causal, B2 N4096 and B1 N8192."""
    mla = suite("mla")
    assert [(c.batch, c.seqlen) for c in mla] == ROWS
    assert {(c.heads, c.kv_heads, c.head_dim, c.dv, c.causal, c.dtype) for c in mla} == \
        {(128, 128, 192, 128, True, "bfloat16")}
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, "DeepseekV3Config", None)
    if config is None:
        pytest.skip("transformers without DeepSeek-V3")
    cfg = config()
    names = ("num_attention_heads", "num_key_value_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    if any(getattr(cfg, n, None) is None for n in names):
        pytest.skip("DeepseekV3Config without the attention fields this test reads")
    assert {(c.heads, c.kv_heads, c.head_dim, c.dv) for c in mla} == \
        {(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
          cfg.v_head_dim)}


def test_gemma_suite_end_to_end(monkeypatch, tmp_path):
    """``--suite gemma --mode fwd+bwd`` (small cases of its rules; on a CPU reduced again, the GPU peers n/a):
    the gstar and eager rows checked and timed, forward and backward."""
    small = [Case("gemma", b, 16, 8, n, 32, causal=True, window=w) for b, n in ((2, 512), (1, 1024))
             for w in ((-1, -1), (511, 0), (127, 0))]
    monkeypatch.setitem(cases.SUITES, "gemma", lambda: small)
    monkeypatch.setattr(measure, "CPU_BUDGET_S", 0.0)
    path = tmp_path / "gemma.json"
    assert main(["bench", "--suite", "gemma", "--mode", "fwd+bwd", "--impls", "gstar,eager,fa4",
                 "--json", str(path)]) == 0
    cpu = not torch.cuda.is_available()
    data = json.loads(path.read_text())
    assert data["suite"] == "gemma" and data["complete"]
    rows = data["rows"]
    assert [Case.from_dict(r["case"]) for r in rows[::3]] == ([for_cpu(c) for c in small] if cpu else small)
    for r in rows:
        if r["impl"] in ("gstar", "eager"):
            assert r["status"] == "ok" and r["time_ms"] > 0, r
            assert {c["name"].split()[0] for c in r["checks"]} == {"out", "dq", "dk", "dv"}
        elif cpu:
            assert r["reason"] == "needs CUDA", r
