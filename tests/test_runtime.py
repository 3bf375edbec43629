"""runtime: no launch hands cuTile a size-1 dimension whose stride passes int32 (a batch-1 view
of a larger tensor), without copying."""

import pytest
import torch

from mamba2_cutile.runtime import INT32_LIMIT, as_kernel_input, narrow_unit_strides, needs_int64
from mamba2_cutile.ssd import backward, forward


def test_narrow_unit_strides_is_a_view_with_small_unit_strides():
    t = torch.arange(12.0).reshape(1, 3, 4)     # defined values: empty memory may hold NaN
    big = t.as_strided((1, 3, 4), (2**33, 4, 1))
    v = narrow_unit_strides(big)
    assert v.stride() == (4, 4, 1) and v.data_ptr() == big.data_ptr()
    torch.testing.assert_close(v, big, rtol=0, atol=0)
    assert narrow_unit_strides(t) is t          # nothing to change: the same object
    assert narrow_unit_strides(3) == 3 and narrow_unit_strides(None) is None
    lone = torch.empty(1).as_strided((1, 1), (2**32, 2**32))
    assert narrow_unit_strides(lone).stride() == (1, 1)
    assert as_kernel_input(big).stride() == (4, 4, 1)


def test_needs_int64_counts_the_strided_extent():
    m = lambda *s: torch.empty(s, device="meta")  # noqa: E731
    assert not needs_int64(None, m(0, 2**33), m(2**31 - 1), m(3, 4))
    assert needs_int64(m(2**31)) and needs_int64(m(2, 2**30))
    whole = m(3, 2**30)                        # over 2^31 elements; its slices by extent:
    assert not needs_int64(whole[:2, :8], whole[:2, :7].t()) and needs_int64(whole[:, :8])
    assert needs_int64(m(1).as_strided((2, 1), (2**31, 1)))       # extent past int32, 2 elements
    assert not needs_int64(m(1, 3).as_strided((1, 3), (2**40, 1)))  # a size-1 dim's stride


def test_as_kernel_input_copies_only_what_the_kernels_cannot_load():
    t = torch.arange(24.0).reshape(2, 3, 4)
    assert as_kernel_input(t) is t and as_kernel_input(t[:, 1:]) is not None
    sl = t[:, :, 1:3]                           # unit innermost stride: a view, no copy
    assert as_kernel_input(sl).data_ptr() == sl.data_ptr()
    for bad in (t.transpose(1, 2), torch.arange(4.0).expand(3, 4)):
        got = as_kernel_input(bad)
        assert got.is_contiguous() and torch.equal(got, bad)
    assert as_kernel_input(t, torch.float64).dtype == torch.float64
    assert as_kernel_input(torch.tensor(2.0)).dim() == 0 and as_kernel_input(None) is None


def _unit_dim_strides(calls):
    worst = 0
    for call in calls:
        for a in call.args:
            if isinstance(a, torch.Tensor):
                worst = max([worst] + [abs(s) for n, s in zip(a.shape, a.stride()) if n == 1])
    return worst


def _half_problem(l=270_000, h=128, g=8, p=64, n=128):
    """The first half of a batch-1 sequence of 2.2e9 x elements, as views of the whole (so the
    batch strides of the whole, past int32), on meta tensors."""
    e = lambda *s, dt=torch.bfloat16: torch.empty(s, dtype=dt, device="meta")  # noqa: E731
    cut = l // 2 // 256 * 256
    whole = dict(x=e(1, l, h, p), dt=e(1, l, h, dt=torch.float32), B=e(1, l, g, n),
                 C=e(1, l, g, n))
    half = {k: v[:, :cut] for k, v in whole.items()}
    assert half["x"].stride(0) > INT32_LIMIT and half["x"].numel() < 2**31
    return half, torch.empty(h, device="meta")


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_batch1_view_of_a_larger_tensor_runs_32_bit_with_small_strides(direction):
    half, A = _half_problem()
    if direction == "forward":
        calls = forward.forward_launches(half["x"], half["dt"], A, half["B"], half["C"], 256)[0]
    else:
        calls = []
        backward.run_backward(half["x"], half["dt"], A, half["B"], half["C"], 256,
                              torch.empty_like(half["x"]), launch_fn=calls.extend)
    names = [c.kernel._annotated_function.pyfunc.__name__ for c in calls]
    assert calls and not any(n.endswith("_i64") for n in names)
    assert _unit_dim_strides(calls) <= INT32_LIMIT


def test_seq_ids_int32_keeps_ids_apart_past_int32():
    """int64 ids that do not fit int32 are replaced by their rank in the row: every pair of
    tokens (at any distance, ids in any order) compares equal and ordered as before, and the
    sign (padding) is kept; ids that fit are cast."""
    from mamba2_cutile.runtime import seq_ids_int32
    big = 2**31
    s = torch.tensor([[-9, -9, -3, 0, 0, big, big, 2**40, 5, 0, -9],
                      [1, 1, 2, 2, 3, 3, 4, 4, 4, 7, 1],
                      [big + 3, -1, big + 3, big + 5, big + 3, -1, 0, 0, 2, big, 2]])
    r = seq_ids_int32(s)
    assert r.dtype == torch.int32 and r.is_contiguous()
    assert torch.equal(r[:, :, None] == r[:, None, :], s[:, :, None] == s[:, None, :])
    assert torch.equal(r[:, :, None] < r[:, None, :], s[:, :, None] < s[:, None, :])
    assert torch.equal(r < 0, s < 0)
    fits = torch.tensor([[-1, 0, 7, 2**31 - 1]])
    assert torch.equal(seq_ids_int32(fits), fits.to(torch.int32))
    i32 = torch.tensor([[3, 4]], dtype=torch.int32)
    assert seq_ids_int32(i32) is i32 and seq_ids_int32(None) is None
    assert seq_ids_int32(torch.empty(2, 0, dtype=torch.int64)).shape == (2, 0)
    assert seq_ids_int32(torch.zeros(1, 4, dtype=torch.int64, device="meta")).dtype == torch.int32


class _FakeStream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append(f"{self.name} waits {other.name}")


def _fake_cuda(monkeypatch, log, fail_at=None):
    """launch_calls with recording stand-ins for the CUDA streams and ct.launch."""
    import cuda.tile as ct

    from mamba2_cutile import runtime
    main = _FakeStream("main", log)
    made = iter(range(100))
    monkeypatch.setattr(runtime, "_SIDE_STREAMS", {})
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "Stream",
                        lambda device=None: _FakeStream(f"side{next(made)}", log))

    def launch(stream, grid, kernel, args):
        if kernel == fail_at:
            raise RuntimeError("launch failed")
        log.append(f"{kernel} on {stream.name}")
    monkeypatch.setattr(ct, "launch", launch)
    return runtime


def test_launch_calls_side_streams(monkeypatch):
    """A side-stream call waits for the caller's stream before it launches; the caller's
    stream waits for the side streams at a join and at the plan's end, never before."""
    from mamba2_cutile.runtime import KernelCall
    log = []
    runtime = _fake_cuda(monkeypatch, log)
    calls = [KernelCall("a", (1,), ()), KernelCall("b", (1,), (), stream=1),
             KernelCall("c", (1,), (), stream=2), KernelCall("d", (1,), ()),
             KernelCall("e", (1,), (), join=True), KernelCall("f", (1,), (), stream=1)]
    runtime.launch_calls(calls, torch.device("cuda"))
    assert log == ["a on main",
                   "side0 waits main", "b on side0",
                   "side1 waits main", "c on side1",
                   "d on main",
                   "main waits side0", "main waits side1", "e on main",
                   "side0 waits main", "f on side0",
                   "main waits side0"]


def test_launch_calls_joins_side_streams_when_a_launch_raises(monkeypatch):
    """A launch that raises after a side launch still leaves the caller's stream waiting for
    it (the plan's buffers are freed on the caller's stream while the error unwinds)."""
    from mamba2_cutile.runtime import KernelCall
    log = []
    runtime = _fake_cuda(monkeypatch, log, fail_at="c")
    calls = [KernelCall("a", (1,), ()), KernelCall("b", (1,), (), stream=1),
             KernelCall("c", (1,), ())]
    with pytest.raises(RuntimeError, match="launch failed"):
        runtime.launch_calls(calls, torch.device("cuda"))
    assert log == ["a on main", "side0 waits main", "b on side0", "main waits side0"]
