"""The ten stages of ``gstar check`` and their shapes.

Stages 1-9 build up from tiled attention in PyTorch to the Triton backward with GQA, a sliding window and
sink tokens; stage 10 is GPT-OSS (learned sinks). GPU shapes are the reference cases of docs/design.md
section 5 (the ``stages`` suite of ``gstar bench``): the windowed stages use a 256-key window,
``window=(255, 0)``, and 4 sink tokens. CPU shapes are small and odd, so that the Triton interpreter gets
through them in under a minute of CPU time; the interpreter is unreliable for bfloat16, so CPU stages use
float16 and float32 (float32 is judged by relative error < 1e-4, the others by 2x / 3x PyTorch's own
error). Shapes are ``(B, Hq, Hkv, N, D)``.

=====  =============================  ============================================  ============================
stage  what                           GPU shapes (bf16)                             CPU shapes (interpreter)
=====  =============================  ============================================  ============================
1      PyTorch tiled attention        (1,8,8,512,16) full; causal: (1,8,8,1024,16)  fp32: (1,2,2,70,16) full,
       (online softmax)               (1,16,16,2048,16) (1,16,16,4096,16)           (1,2,2,113,32) causal
2      Triton weighted row sum x @ w  fp32 rows x cols: 512x1024 1024x4096          fp32: 70x96, 113x257
                                      2048x8192 4096x8192
3      non-causal attention           (1,8,8,512,16) (1,8,8,1024,16)                fp16: (1,2,2,64,16)
                                      (1,16,16,2048,16) (1,16,16,4096,16)           (1,2,2,113,32)
4      causal attention               as stage 3, causal                            as stage 3, causal
5      GQA, causal                    (1,8,2,512,16) (1,8,2,1024,16)                fp16: (1,4,2,64,16)
                                      (1,16,2,2048,16) (1,16,2,4096,16)             (1,4,1,113,32)
6      GQA + sliding window (255, 0)  (1,8,2,512,16) (1,8,2,1024,16)                fp16: (1,4,2,96,16) (31,0)
                                      (1,16,2,2048,16) (1,16,1,4096,16)             (1,4,1,160,32) (47,0)
7      stage 6 + 4 sink tokens        as stage 6                                    as stage 6
8      GQA backward, causal           (1,16,16,4096,16) (1,16,8,4096,16)            fp32: (1,4,4,64,16)
                                      (1,16,1,4096,16)                              (1,4,2,70,16) (1,4,1,113,16)
9      stage 7, backward              (1,16,2,2048,16) (1,16,1,4096,16)             fp32: as stage 7
10     GPT-OSS: GQA + learned sinks,  (1,64,8,4096,64) causal;                      fp16: (1,8,1,128,64) (15,0);
       forward and backward           (1,64,8,4096,64) (2,64,8,4096,64) (127,0)     fp32: (1,8,2,113,64) causal
=====  =============================  ============================================  ============================

Each stage's speed and memory are measured on its last shape, forward only for stages 1-7 and forward
plus backward for stages 8-10. On a CPU a stage run by the Triton interpreter is checked but not raced: the
interpreter is no speed measurement.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..bench.cases import Case


@dataclass(frozen=True)
class RowSumCase:
    """Stage 2's problem: ``x (rows, cols) @ w (cols,)``."""

    rows: int
    cols: int
    dtype: str = "float32"

    @property
    def label(self) -> str:
        return f"(rows={self.rows}, cols={self.cols}) {self.dtype}"


@dataclass(frozen=True)
class Stage:
    """One stage: its number, title, whether it checks gradients, and its GPU and CPU cases."""

    number: int
    title: str
    backward: bool
    gpu: tuple
    cpu: tuple

    @property
    def kind(self) -> str:
        """``tiled`` (stage 1), ``rowsum`` (stage 2) or ``kernel`` (the Triton attention stages)."""
        return {1: "tiled", 2: "rowsum"}.get(self.number, "kernel")

    def cases(self, device_type: str) -> tuple:
        return self.gpu if device_type == "cuda" else self.cpu


def _c(b, hq, hkv, n, d, dtype="bfloat16", **pattern) -> Case:
    return Case("check", b, hq, hkv, n, d, dtype=dtype, **pattern)


_LADDER = ((1, 8, 512), (1, 8, 1024), (1, 16, 2048), (1, 16, 4096))  # (B, H, N) of the GPU cases of stages 3-5
_W, _S = (255, 0), 4
_CPU_WIN = (("float16", 4, 2, 96, 16, (31, 0)), ("float16", 4, 1, 160, 32, (47, 0)))


def _gpu_window(sink_tokens: int) -> tuple:
    kv = (2, 2, 2, 1)
    return tuple(_c(b, h, g, n, 16, causal=True, window=_W, sink_tokens=sink_tokens)
                 for (b, h, n), g in zip(_LADDER, kv))


def _cpu_window(sink_tokens: int, dtype: str | None = None) -> tuple:
    return tuple(_c(1, h, g, n, d, dtype or dt, causal=True, window=w, sink_tokens=sink_tokens)
                 for dt, h, g, n, d, w in _CPU_WIN)


STAGES = {s.number: s for s in (
    Stage(1, "PyTorch tiled attention", False,
          gpu=(_c(1, 8, 8, 512, 16),) + tuple(_c(b, h, h, n, 16, causal=True) for b, h, n in _LADDER[1:]),
          cpu=(_c(1, 2, 2, 70, 16, "float32"), _c(1, 2, 2, 113, 32, "float32", causal=True))),
    Stage(2, "Triton weighted row sum", False,
          gpu=(RowSumCase(512, 1024), RowSumCase(1024, 4096), RowSumCase(2048, 8192), RowSumCase(4096, 8192)),
          cpu=(RowSumCase(70, 96), RowSumCase(113, 257))),
    Stage(3, "non-causal attention", False,
          gpu=tuple(_c(b, h, h, n, 16) for b, h, n in _LADDER),
          cpu=(_c(1, 2, 2, 64, 16, "float16"), _c(1, 2, 2, 113, 32, "float16"))),
    Stage(4, "causal attention", False,
          gpu=tuple(_c(b, h, h, n, 16, causal=True) for b, h, n in _LADDER),
          cpu=(_c(1, 2, 2, 64, 16, "float16", causal=True), _c(1, 2, 2, 113, 32, "float16", causal=True))),
    Stage(5, "GQA, causal", False,
          gpu=tuple(_c(b, h, 2, n, 16, causal=True) for b, h, n in _LADDER),
          cpu=(_c(1, 4, 2, 64, 16, "float16", causal=True), _c(1, 4, 1, 113, 32, "float16", causal=True))),
    Stage(6, "GQA + sliding window", False, gpu=_gpu_window(0), cpu=_cpu_window(0)),
    Stage(7, "GQA + sliding window + sink tokens", False, gpu=_gpu_window(_S), cpu=_cpu_window(_S)),
    Stage(8, "GQA backward", True,
          gpu=tuple(_c(1, 16, g, 4096, 16, causal=True) for g in (16, 8, 1)),
          cpu=tuple(_c(1, 4, g, n, 16, "float32", causal=True) for g, n in ((4, 64), (2, 70), (1, 113)))),
    Stage(9, "GQA + sliding window + sink tokens backward", True,
          gpu=_gpu_window(_S)[2:], cpu=_cpu_window(_S, "float32")),
    Stage(10, "GPT-OSS: GQA + window + learned sinks, forward and backward", True,
          gpu=(_c(1, 64, 8, 4096, 64, causal=True, sinks=True),
               _c(1, 64, 8, 4096, 64, causal=True, window=(127, 0), sinks=True),
               _c(2, 64, 8, 4096, 64, causal=True, window=(127, 0), sinks=True)),
          cpu=(_c(1, 8, 1, 128, 64, "float16", causal=True, window=(15, 0), sinks=True),
               _c(1, 8, 2, 113, 64, "float32", causal=True, sinks=True))),
)}


def parse_stage(text: str) -> int:
    """``"3"``, ``"p3"`` or ``"P3"`` -> 3; raises ``ValueError`` for anything but a stage number 1..10."""
    t = text.strip().lower()
    t = t[1:] if t.startswith("p") else t
    if not t.isdigit() or int(t) not in STAGES:
        raise ValueError(f"stage must be one of 1..{len(STAGES)} (or p1..p{len(STAGES)}), got {text!r}")
    return int(t)
