"""CPU: the GPU path's varlen_states glue (`ssd.varlen.varlen_states_from_chunks`), fed with what
the forward kernels store (dt', log2 cumsum, chunk entry states), against the recurrence."""

import math

import pytest
import torch

from mamba2_cutile import reference
from mamba2_cutile.ssd.varlen import varlen_states_from_chunks

CASES = {
    "plain": [0, 30, 64, 64, 129, 200],
    "leading-empty": [0, 0, 5, 25, 200],
    "first-ends-in-chunk-0": [0, 10, 200],
    "ends-on-boundaries": [0, 64, 128, 192, 200],
    "one-long": [0, 200],
    "trailing-empty": [0, 100, 200, 200],
    "single-tokens": [0, 1, 2, 3, 200],
}


def kernel_intermediates(inp, kw, Q):
    """dt_buf, cum_buf (log2) and entry states as the forward kernels write them."""
    x = inp["x"]
    b, l, h, p = x.shape
    n = inp["B"].shape[-1]
    nc = -(-l // Q)
    dt = reference.process_dt(inp["dt"], None, False)
    dt_buf = torch.zeros(b, h, nc * Q, dtype=x.dtype)
    dt_buf[:, :, :l] = dt.transpose(1, 2)
    a = (dt_buf * inp["A"][None, :, None]).reshape(b, h, nc, Q)
    cum_buf = (torch.cumsum(a, dim=-1) / math.log(2)).reshape(b, h, nc * Q)
    h0 = kw.get("initial_states")
    states = torch.zeros(b, h, nc, p, n, dtype=x.dtype)
    for c in range(nc):
        if c == 0:
            states[:, :, 0] = 0 if h0 is None else h0
        else:
            pre = {k: v[:, :c * Q] for k, v in inp.items() if k not in ("A",)}
            pre["A"] = inp["A"]
            kwp = dict(kw)
            kwp["seq_idx"] = kw["seq_idx"][:, :c * Q]
            _, hc, _ = reference.ssd_recurrence(**pre, **kwp)
            states[:, :, c] = hc
    # the kernels write these in float32 (states in the state dtype: float32 here)
    return dt_buf.float(), cum_buf.float(), states.float()


@pytest.mark.parametrize("with_init", [False, True])
@pytest.mark.parametrize("name", list(CASES))
def test_varlen_glue(name, with_init):
    cu_list = CASES[name]
    l, h, g, p, n, Q = 200, 4, 2, 3, 5, 64
    gen = torch.Generator().manual_seed(7)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    inp = dict(x=r(1, l, h, p), dt=r(1, l, h).abs() * 0.2, A=-torch.rand(h, generator=gen,
               dtype=torch.float64) - 0.5, B=r(1, l, g, n), C=r(1, l, g, n))
    cu = torch.tensor(cu_list, dtype=torch.int32)
    seq = torch.zeros(1, l, dtype=torch.int32)
    for s, (a, e) in enumerate(zip(cu_list[:-1], cu_list[1:])):
        seq[0, a:e] = s
    kw = dict(seq_idx=seq)
    if with_init:
        kw["initial_states"] = r(1, h, p, n)
    _, _, v_ref = reference.ssd_recurrence(**inp, cu_seqlens=cu, **kw)
    dt_buf, cum_buf, states = kernel_intermediates(inp, kw, Q)
    init = kw.get("initial_states")
    v = varlen_states_from_chunks(inp["x"], inp["B"], dt_buf, cum_buf, states,
                                  None if init is None else init.float(), cu, Q)
    torch.testing.assert_close(v.double(), v_ref, rtol=1e-4, atol=1e-4)
    # and the chunked reference (what CPU tensors run) agrees too
    _, _, v_chunked = reference.ssd_chunked(**inp, chunk_size=Q, cu_seqlens=cu,
                                            dtype=torch.float64, **kw)
    torch.testing.assert_close(v_chunked, v_ref, rtol=1e-9, atol=1e-9)


def test_empty_sequence_varlen_states_on_cpu():
    """l = 0 on the CPU path: every sequence is empty and starts at token 0, so each varlen
    state is the initial state (zeros without one)."""
    from mamba2_cutile import mamba_chunk_scan_combined
    x, dt, A = torch.randn(1, 0, 2, 4), torch.rand(1, 0, 2), -torch.rand(2)
    B = torch.randn(1, 0, 1, 3)
    init = torch.randn(1, 2, 4, 3)
    cu = torch.tensor([0, 0, 0])
    y, v = mamba_chunk_scan_combined(x, dt, A, B, B, 64, cu_seqlens=cu, return_varlen_states=True,
                                     initial_states=init, state_dtype=torch.float32)
    assert y.shape == (1, 0, 2, 4) and v.shape == (2, 2, 4, 3)
    assert torch.equal(v, init[0].expand(2, 2, 4, 3))
    _, v0 = mamba_chunk_scan_combined(x, dt, A, B, B, 64, cu_seqlens=cu, return_varlen_states=True)
    assert torch.equal(v0, torch.zeros(2, 2, 4, 3))


@pytest.mark.parametrize("name, token, value", [
    ("x", 50, math.nan), ("x", 80, math.nan), ("x", 100, math.inf), ("B", 128, math.nan),
    ("dt", 45, math.inf), ("dt", 129, math.nan)])
def test_varlen_glue_keeps_other_sequences_clean(name, token, value):
    """A NaN/Inf in one packed sequence (x, B or dt; in the chunk where another sequence ends,
    before or after its tokens, or in the state carried into it) leaves every other sequence's varlen state equal to a clean
    run's, with the buffers the forward kernels write (their plan emulated in float64): the
    glue selects other sequences' tokens and a state carried from another sequence away."""
    pytest.importorskip("cuda.tile")
    from dataclasses import replace
    from mamba2_cutile.ssd import forward
    from support.emulator import emulate_launch

    cu_list = [0, 40, 70, 130, 150]
    l, h, p, n, Q = 150, 2, 8, 8, 32
    gen = torch.Generator().manual_seed(11)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    inp = dict(x=r(1, l, h, p), dt=torch.rand(1, l, h, generator=gen, dtype=torch.float64) * 0.3,
               A=-torch.rand(h, generator=gen, dtype=torch.float64) - 0.5, B=r(1, l, 1, n),
               C=r(1, l, 1, n))
    seq = torch.zeros(1, l, dtype=torch.int32)
    for s, (a, e) in enumerate(zip(cu_list[:-1], cu_list[1:])):
        seq[0, a:e] = s
    cu = torch.tensor(cu_list, dtype=torch.int32)

    def varlen(t):
        nc = -(-l // Q)
        nan = lambda *s: torch.full(s, math.nan, dtype=torch.float64)  # noqa: E731
        dt_buf, cum_buf, states = nan(1, h, nc * Q), nan(1, h, nc * Q), nan(1, h, nc, p, n)
        cfg = replace(forward.forward_shape_config(1, h, p, n, Q, torch.float64),
                      cumsum_block_h=2, state_block_p=8, state_block_n=8, scan_block_p=8,
                      dstate_pad=8, scan_block_q=Q)
        calls = forward.forward_plan(t["x"], t["dt"], t["A"], t["B"], t["C"], None, None, None,
                                     0.0, math.inf, False, None, seq, dt_buf, cum_buf, states,
                                     nan(1, h, p, n), nan(1, l, h, p), cfg)
        calls[0].args[8].fill_(-(2**30))
        emulate_launch(calls[:2])           # decay_cumsum and the state pass write the buffers
        # the kernels write these in float32
        return varlen_states_from_chunks(t["x"], t["B"], dt_buf.float(), cum_buf.float(),
                                         states.float(), None, cu, Q)

    clean = varlen(inp)
    bad = {k: v.clone() for k, v in inp.items()}
    if name == "B":
        bad["B"][0, token, 0, 3] = value
    elif name == "x":
        bad["x"][0, token, 1, 2] = value
    else:
        bad["dt"][0, token, 1] = value
    got = varlen(bad)
    own = int(seq[0, token])
    assert torch.isfinite(clean).all()
    for s in range(len(cu_list) - 1):
        if s != own:
            err = ((got[s] - clean[s]).abs().max() / clean[s].abs().max()).item()
            # bit-equal, but where a NaN dt shares the sequence's last chunk: its step enters
            # the chunk's float32 log2 cumsum as -MAX_LOG2_STEP (decay_cumsum), shifting G by a
            # constant, so the decays agree to rounding (measured 1.0e-5 relative)
            tol = 1e-4 if name == "dt" and math.isnan(value) else 0.0
            assert err <= tol, (s, err)
