"""The launch cache (gstar.kernels.launch): equal keys only where Triton's specialisation is equal."""

import inspect
from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from gstar.kernels import launch as launching
from gstar.kernels.common.descriptors import tiles
from gstar.kernels.launch import constexprs, launch


@triton.jit
def _scaled_copy(X, Y, n, stride, factor, BLOCK: tl.constexpr, NEGATE: tl.constexpr = False):
    """Y[i] = factor * X[i * stride] for i < n (negated with NEGATE)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    y = tl.load(X + i * stride, mask=i < n) * factor
    tl.store(Y + i, -y if NEGATE else y, mask=i < n)


def _never_compiled(X, n, stride, factor, BLOCK: tl.constexpr, NEGATE: tl.constexpr = False):
    """A kernel signature for the CPU tests of the cache: they replace its launcher, so it never runs."""


class _Recorder:
    """Stands in for Triton on the CPU: ``triton`` records launches through ``fn[grid]`` (and returns a
    compiled-kernel stand-in), the stand-in's ``run`` records direct launches."""

    function, packed_metadata = "function handle", "packed metadata"

    def __init__(self, monkeypatch):
        self.calls, self.cache = [], None
        self.fn = JITFunction(_never_compiled)  # a real JITFunction even under the interpreter
        monkeypatch.setattr(launching, "_replay", None)  # a process that has not launched yet
        monkeypatch.setattr(self.fn, "run", self.triton)
        monkeypatch.setattr(launching, "driver", SimpleNamespace(active=SimpleNamespace(
            get_current_device=lambda: 0, get_current_stream=lambda device: "stream")))

    def triton(self, *args, grid, warmup, **kwargs):
        self.calls.append(("triton", args, kwargs))
        return self

    def run(self, *launcher_args):
        self.calls.append(("direct", launcher_args))

    def launch(self, x, *scalars, **kwargs):
        if self.cache is None:  # the kernel's parameters by name, learnt at its first launch
            self.cache = launching._KernelCache(self.fn, dict(zip(("X", "n", "stride", "factor"), (x, *scalars))))
        launching._launch(self.fn, self.cache, (3, 1, 1), 0, (x,), scalars, constexprs(num_warps=4, **kwargs))
        return self.calls[-1][0]


def test_cache_hits_launch_the_compiled_kernel_with_every_argument(monkeypatch):
    """On a hit the compiled kernel gets the grid, stream, handles, no hooks, the runtime arguments and
    then the constexprs in signature order (defaults included); any change of key goes through Triton."""
    rec = _Recorder(monkeypatch)
    aligned, shifted = _aligned_and_shifted(64)
    assert rec.launch(aligned, 5, 16, 0.5, BLOCK=32) == "triton"
    assert rec.launch(aligned, 5, 16, 2.0, BLOCK=32) == "direct"
    assert rec.calls[-1][1] == (3, 1, 1, "stream", "function handle", "packed metadata", None, None, None,
                                aligned, 5, 16, 2.0, 32, False)
    assert rec.launch(shifted, 5, 16, 2.0, BLOCK=32) == "triton"       # alignment
    assert rec.launch(aligned, 5, 17, 2.0, BLOCK=32) == "triton"       # an int's class (16 | 16, 17 not)
    assert rec.launch(aligned, 7, 48, 2.0, BLOCK=32) == "direct"       # the same classes: new values passed on
    assert rec.calls[-1][1][9:13] == (aligned, 7, 48, 2.0)
    assert rec.launch(aligned, 7, 48, 2.0, BLOCK=32) == "direct"       # and now an exact hit
    assert rec.launch(aligned, 5, 16, 2.0, BLOCK=64) == "triton"       # a constexpr
    assert rec.launch(aligned, 5, 16, 2.0, BLOCK=32, NEGATE=True) == "triton"
    assert rec.launch(aligned, 5, 16, 2.0, BLOCK=32, NEGATE=True) == "direct"
    assert rec.calls[-1][1][-2:] == (32, True)
    assert rec.launch(shifted, 5, 16, 2.0, BLOCK=32) == "direct"


def test_this_triton_launches_the_way_the_cache_replays(monkeypatch):
    """The installed Triton's own launch makes the call the cache replays, so the direct launch is on here."""
    rec = _Recorder(monkeypatch)
    assert launching._TRITON_CALL in " ".join(inspect.getsource(JITFunction.run).split())
    assert launching._replay_supported(rec.fn, rec)


@pytest.mark.parametrize("change", ["call", "kernel attribute", "function attribute"])
def test_launches_fall_back_to_triton_where_its_internals_differ(change, monkeypatch):
    """Where Triton launches compiled kernels differently (another call in JITFunction.run), or a compiled
    kernel or a JITFunction lacks what the replay reads, every launch takes Triton's public path. The check
    runs once, at the first launch; after it no launch spends time on cache keys."""
    rec = _Recorder(monkeypatch)
    if change == "call":
        monkeypatch.setattr(launching, "_TRITON_CALL", "kernel.run(grid_0, grid_1, grid_2, stream, kernel.handle)")
    elif change == "kernel attribute":
        monkeypatch.delattr(_Recorder, "packed_metadata")
    else:
        monkeypatch.delattr(rec.fn, "arg_names")
    checks, keys = [], []
    supported, tensor_key = launching._replay_supported, launching._tensor_key
    monkeypatch.setattr(launching, "_replay_supported", lambda *a: checks.append(a) or supported(*a))
    monkeypatch.setattr(launching, "_tensor_key", lambda *a: keys.append(a) or tensor_key(*a))
    x = torch.zeros(64)
    assert rec.launch(x, 5, 16, 1.0, BLOCK=32) == "triton"
    assert len(checks) == 1 and launching._replay is False and len(keys) == 1
    assert [rec.launch(x, 5, 16, 1.0, BLOCK=32) for _ in range(2)] == ["triton"] * 2
    assert [rec.launch(x, 7, 16, 1.0, BLOCK=64) for _ in range(2)] == ["triton"] * 2
    assert len(checks) == 1 and len(keys) == 1


def test_a_launch_hook_turns_the_cache_off(monkeypatch):
    from triton import knobs

    assert not launching._hooked(None) and launching._hooked(print)  # older triton: None or a callable

    chain = knobs.runtime.launch_enter_hook
    if not hasattr(chain, "add"):
        pytest.skip("this triton has no hook chain")
    rec = _Recorder(monkeypatch)
    x = torch.zeros(64)

    def hook(metadata):
        pass

    chain.add(hook)
    try:
        assert [rec.launch(x, 5, 16, 1.0, BLOCK=32) for _ in range(2)] == ["triton", "triton"]
    finally:
        chain.remove(hook)
    assert [rec.launch(x, 5, 16, 1.0, BLOCK=32) for _ in range(2)] == ["triton", "direct"]


def _aligned_and_shifted(n, dtype=torch.float16, device="cpu"):
    storage = torch.randn(n + 8, dtype=dtype, device=device)
    return storage[:n], storage[1:n + 1]                          # base 0 and 2 bytes past 16-byte alignment


def test_keys_separate_what_triton_specialises_on():
    aligned, shifted = _aligned_and_shifted(64)
    tensors = launching._tensor_key
    assert tensors((aligned,)) != tensors((shifted,))                # pointer alignment
    assert tensors((aligned,)) != tensors((aligned.float(),))        # dtype
    assert tensors((aligned,)) == tensors((aligned.clone(),))        # not the storage
    assert tensors((aligned, None)) != tensors((aligned, aligned))   # an absent pointer
    assert tensors((tiles(torch.randn(1, 1, 32, 16), (1, 1, 16, 16)),)) is None  # descriptors: Triton's own path
    classes = launching._classes
    assert classes((1,)) != classes((17,)) != classes((16,))
    assert classes((17, -1)) == classes((5, 3))                      # neither 1 nor a multiple of 16
    assert classes((0, -32)) == classes((4096, 2 ** 30))             # multiples of 16
    assert classes((2 ** 31 - 1,)) != classes((2 ** 31 + 1,))        # 32 and 64 bits
    assert classes((-2 ** 31,)) == classes((16,)) != classes((-2 ** 31 - 16,))
    assert classes((2 ** 63 + 1,)) != classes((2 ** 62 + 1,))        # wider than int64
    assert classes((0.5,)) == classes((2.0,)) != classes((2,))        # floats by type only, not ints
    assert classes((True,)) != classes((1,))                         # a bool is not the int 1
    assert classes(("text",)) is None                                # anything else: Triton's own path
    assert classes(((1, 16, 17),)) == classes(((1, 32, 5),))         # a tuple of strides, element by element
    assert classes(((1, 16, 17),)) != classes(((2, 16, 17),)) != classes(((1, 17, 17),))
    assert classes(((16, 1),)) != classes((16, 1))                   # one tuple argument is not two ints
    assert classes(((1, "text"),)) is None


def _run_and_check(device, x, n, stride, factor, negate=False):
    y = torch.full((n,), float("nan"), dtype=x.dtype, device=device)
    launch(_scaled_copy, (triton.cdiv(n, 32), 1, 1), dict(Y=y, factor=factor, X=x, stride=stride, n=n),
           constexprs(BLOCK=32, NEGATE=negate, num_warps=1, num_stages=1))
    want = x[: n * stride: stride] * factor
    torch.testing.assert_close(y, -want if negate else want)


def test_arguments_go_by_name():
    """A launch orders its arguments by the kernel's parameters, whatever order they come in: the pointers,
    then the runtime scalars (the constexprs come as options); a missing one is named."""
    cache = launching._KernelCache(_scaled_copy, dict(factor=1.0, n=3, stride=1, Y=None, X=torch.zeros(3)))
    assert cache.names == ("X", "Y", "n", "stride", "factor") and cache.pointers == 2
    x = torch.zeros(64)
    with pytest.raises(KeyError, match="stride"):
        launch(_scaled_copy, (1, 1, 1), dict(X=x, Y=x, n=3, factor=1.0), constexprs(BLOCK=32))


def test_launch_runs_the_kernel(device):
    """On CPU (interpreter) every launch takes Triton's own path; on a GPU the second one hits the cache."""
    launching._caches.pop(_scaled_copy, None)
    x = torch.randn(103, device=device)
    for factor in (2.0, 3.0):
        _run_and_check(device, x, 33, 3, factor)
    entries = launching._caches.get(_scaled_copy)
    assert (len(entries.by_class) if entries else 0) == (1 if device == "cuda" else 0)


@pytest.mark.gpu
def test_cached_launches_respect_specialisation():
    """Repeated launches alternate between signatures that compile differently: shifted pointers,
    strides of 1 and 16, constexpr flags; each result is checked, and each signature gets its own entry."""
    launching._caches.pop(_scaled_copy, None)
    aligned, shifted = _aligned_and_shifted(4096, device="cuda")
    assert shifted.data_ptr() % 16
    calls = [(aligned, 100, 1, False), (shifted, 100, 1, False), (aligned, 100, 16, False),
             (shifted, 37, 3, True), (aligned, 100, 1, True)]
    for _ in range(2):
        for x, n, stride, negate in calls:
            _run_and_check("cuda", x, n, stride, 1.5, negate)
    assert len(launching._caches[_scaled_copy].by_class) == len(calls)


@pytest.mark.gpu
def test_cache_serves_lengths_of_one_class():
    """Lengths that Triton does not tell apart (a decode loop's) share one compiled kernel, and every
    launch still gets its own values."""
    launching._caches.pop(_scaled_copy, None)
    x = torch.randn(3000, device="cuda")
    for n in (100, 101, 37, 53, 999, 37):
        _run_and_check("cuda", x, n, 3, 1.5)
    assert len(launching._caches[_scaled_copy].by_class) == 1
    assert len(launching._caches[_scaled_copy].exact) == 5


@pytest.mark.gpu
def test_decode_steps_reuse_one_kernel():
    """One query per step against a K/V cache that grows by one key (a new tensor each step, as
    transformers' DynamicCache makes with torch.cat): each step matches the reference, and the forward
    kernel's class map stops growing once each int class has been seen."""
    import gstar
    from gstar.kernels.portable.forward import _forward
    from gstar.reference import naive_attention

    B, Hq, Hkv, D = 1, 8, 2, 64
    k = torch.randn(B, Hkv, 40, D, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    sinks = torch.randn(Hq, device="cuda")
    compiled = []
    for _ in range(40):
        k = torch.cat([k, torch.randn_like(k[:, :, :1])], dim=2)
        v = torch.cat([v, torch.randn_like(v[:, :, :1])], dim=2)
        q = torch.randn(B, Hq, 1, D, dtype=torch.bfloat16, device="cuda")
        out = gstar.flash_attention(q, k, v, sinks=sinks, causal=True, window=(31, 0))
        ref, _ = naive_attention(q.float(), k.float(), v.float(), sinks=sinks, causal=True, window=(31, 0))
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=0)
        compiled.append(len(launching._caches[_forward].by_class))
    assert compiled[-30:] == [compiled[-1]] * 30


@pytest.mark.gpu
def test_attention_with_shifted_inputs_after_aligned_ones():
    """A cached kernel compiled for 16-byte-aligned q, k, v must not serve the same shapes 2 bytes off:
    the shifted call takes its own compiled kernel (which may round differently, hence assert_close), and
    the aligned call after it is bitwise the first one again."""
    import gstar

    B, H, N, D = 1, 4, 100, 64
    numel = B * H * N * D
    values = torch.randn(3, numel, dtype=torch.bfloat16, device="cuda")
    dout = torch.randn(B, H, N, D, dtype=torch.bfloat16, device="cuda")

    def run(offset):
        storage = torch.empty(3, numel + 8, dtype=torch.bfloat16, device="cuda")  # rows 16-byte aligned
        storage[:, offset:offset + numel] = values
        q, k, v = (storage[i, offset:offset + numel].view(B, H, N, D).detach().requires_grad_() for i in range(3))
        assert (q.data_ptr() % 16 == 0) == (offset == 0)
        out = gstar.flash_attention(q, k, v, causal=True, window=(31, 0))
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    aligned, shifted, again = run(0), run(1), run(0)
    for a, s, r in zip(aligned, shifted, again):
        torch.testing.assert_close(s, a)
        assert torch.equal(a, r)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_tensors_on_a_device_that_is_not_current():
    """A model spread over GPUs calls attention on cuda:1 while cuda:0 is current: the kernels must run
    on cuda:1 (twice, so that the second call takes the cache) and give cuda:0's results bitwise."""
    import gstar

    B, Hq, Hkv, N, D = 1, 4, 2, 77, 64
    cpu = [torch.randn(B, h, N, D, dtype=torch.bfloat16) for h in (Hq, Hkv, Hkv)]
    sinks, dout = torch.randn(Hq), torch.randn(B, Hq, N, D, dtype=torch.bfloat16)

    def run(device):
        q, k, v, s = (t.to(device).requires_grad_() for t in (*cpu, sinks))
        out = gstar.flash_attention(q, k, v, sinks=s, causal=True, window=(20, 0))
        return [t.cpu() for t in (out, *torch.autograd.grad(out, (q, k, v, s), dout.to(device)))]

    torch.cuda.set_device(0)
    want = run("cuda:0")
    for _ in range(2):
        got = run("cuda:1")
        assert torch.cuda.current_device() == 0
        for g, w in zip(got, want):
            assert torch.equal(g, w)
