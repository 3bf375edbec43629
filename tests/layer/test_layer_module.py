"""CPU: the `Mamba2` module. Its forward (fused and part by part) equals the float64
composition in_proj -> reference.layer -> out_proj, gradients included; token-by-token `step`
after a prefill equals the forward; a varlen prefill stores each sequence's states; a
mamba_ssm-style state dict (keys and shapes from the constructor's semantics) loads;
torch.compile(fullgraph=True) traces a training step; bad arguments name themselves."""

import pytest
import torch
import torch.nn.functional as F

from mamba2_cutile.layer import InferenceParams, Mamba2
from mamba2_cutile.reference.layer import mamba_split_conv1d_scan_ref

#: float64 everywhere (measured at most 5.1e-16 on outputs, 1.4e-15 on gradients); dA_log
#: passes through A's float32 cast on both sides (measured equal, bound at float32 rounding)
F64_TOL = 2e-14
F32_ROUND_TOL = 2e-7
#: decode after a prefill: the prefill's ssm state comes back as float32 (the scan's final
#: state), so the steps start from a state rounded to 6e-8; measured at most 4.1e-10
STEP_TOL = 2e-9
#: the varlen prefill's states against separate prefills: the same float32 rounding
STATE_TOL = 2e-7


CONFIGS = {
    "default-small": dict(d_model=16, d_state=8, headdim=4, chunk_size=64),
    "mlp-Dp-groups-bias-limit": dict(d_model=12, d_state=6, headdim=4, d_ssm=16, ngroups=2,
                                     D_has_hdim=True, bias=True, dt_limit=(0.01, 0.3),
                                     norm_before_gate=True, chunk_size=64, d_conv=3),
    "no-norm": dict(d_model=10, d_state=4, headdim=5, rmsnorm=False, conv_bias=False,
                    chunk_size=64),
}


def make(name, seed=0, **over):
    torch.manual_seed(seed)
    kw = dict(CONFIGS[name], layer_idx=0, dtype=torch.float64)
    kw.update(over)
    m = Mamba2(**kw)
    with torch.no_grad():       # away from the inits' symmetric values (D = 1, norm = 1)
        m.D.add_(0.3 * torch.randn_like(m.D))
        if m.rmsnorm:
            m.norm.weight.add_(0.2 * torch.randn_like(m.norm.weight))
    return m


def composition(m, u, seq_idx=None):
    """in_proj -> the float64 layer definition -> out_proj, on m's parameters (A in float32,
    as the module computes it)."""
    zxbcdt = F.linear(u, m.in_proj.weight, m.in_proj.bias)
    D = m.D.view(m.nheads, m.headdim) if m.D_has_hdim else m.D
    out, _ = mamba_split_conv1d_scan_ref(
        zxbcdt, m.conv1d.weight[:, 0], m.conv1d.bias, m.dt_bias, -torch.exp(m.A_log.float()), D,
        seq_idx=seq_idx, dt_limit=m.dt_limit, rmsnorm_weight=m.norm.weight if m.rmsnorm else None,
        rmsnorm_eps=1e-5, outproj_weight=m.out_proj.weight, outproj_bias=m.out_proj.bias,
        headdim=m.headdim, ngroups=m.ngroups, norm_before_gate=m.norm_before_gate)
    return out


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "parts"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_and_grads_equal_composition(name, fused):
    m = make(name, use_mem_eff_path=fused)
    u = torch.randn(2, 45, m.d_model, dtype=torch.float64)
    seq = torch.zeros(2, 45, dtype=torch.int32)
    seq[1, 20:] = 1
    out = m(u, seq_idx=seq)
    ref = composition(m, u, seq)
    assert out.shape == u.shape and rel(out, ref) < F64_TOL
    g = torch.randn_like(out)
    params = [p for p in m.parameters()]
    got = torch.autograd.grad(out, params, g)
    want = torch.autograd.grad(ref, params, g)
    for (k, _), a, b in zip(m.named_parameters(), got, want):
        # dA reaches A_log through A's float32 cast: rounded to float32 on both sides
        tol = F32_ROUND_TOL if k == "A_log" else F64_TOL
        assert rel(a, b) < tol, f"d{k}: {rel(a, b):.2e}"


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "parts"])
def test_seq_idx_past_int32(fused):
    """int64 ids past int32 (as the scan takes them): the same output as small ids."""
    m = make("default-small", use_mem_eff_path=fused)
    u = torch.randn(2, 30, m.d_model, dtype=torch.float64)
    seq = torch.zeros(2, 30, dtype=torch.int64)
    seq[1, 12:] = 1
    want = m(u, seq_idx=seq.to(torch.int32))
    for base in (2**31, 2**40):
        assert torch.equal(m(u, seq_idx=seq + base), want), base


def test_flattened_input_with_seqlen():
    m = make("default-small")
    u = torch.randn(2, 9, m.d_model, dtype=torch.float64)
    torch.testing.assert_close(m(u.reshape(18, -1), seqlen=9), m(u).reshape(18, -1))


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "parts"])
@pytest.mark.parametrize("prefill", [2, 11])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_step_after_prefill_equals_forward(name, prefill, fused):
    """Prefill `prefill` tokens (fewer than d_conv too) into the cache, then one token per
    call: the outputs equal the forward over the whole sequence."""
    m = make(name, use_mem_eff_path=fused)
    T = 17
    u = torch.randn(3, T, m.d_model, dtype=torch.float64)
    full = m(u)
    params = InferenceParams(max_seqlen=T, max_batch_size=3)
    outs = [m(u[:, :prefill], inference_params=params)]
    params.seqlen_offset += prefill
    for t in range(prefill, T):
        outs.append(m(u[:, t:t + 1], inference_params=params))
        params.seqlen_offset += 1
    got = torch.cat(outs, dim=1)
    assert rel(got, full) < STEP_TOL
    conv_state, ssm_state = params.key_value_memory_dict[0]
    assert conv_state.shape == (3, m.conv1d.weight.shape[0], m.d_conv)
    assert ssm_state.shape == (3, m.nheads, m.headdim, m.d_state)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "parts"])
def test_step_after_packed_prefill_continues_the_last_sequence(fused):
    """A prefill with seq_idx keeps the state of each row's last sequence, conv cache
    included: the steps after it equal the forward of the whole packed row (the last
    sequence, shorter than d_conv in row 0, never reads the inputs of the one before it)."""
    m = make("mlp-Dp-groups-bias-limit", use_mem_eff_path=fused)
    T, prefill = 12, 9
    u = torch.randn(2, T, m.d_model, dtype=torch.float64)
    seq = torch.tensor([[0] * 8 + [1] * 4, [0] * 3 + [2] * 9], dtype=torch.int32)
    full = m(u, seq_idx=seq)
    params = InferenceParams(max_seqlen=T, max_batch_size=2)
    outs = [m(u[:, :prefill], seq_idx=seq[:, :prefill], inference_params=params)]
    params.seqlen_offset += prefill
    for t in range(prefill, T):
        outs.append(m(u[:, t:t + 1], inference_params=params))
        params.seqlen_offset += 1
    assert rel(torch.cat(outs, dim=1), full) < STEP_TOL


def test_varlen_prefill_keeps_a_bad_sequence_to_itself():
    """An Inf in one packed sequence's last token reaches neither the next sequence's cached
    conv state (shorter than d_conv: its window starts inside the bad one) nor its decode."""
    m = make("mlp-Dp-groups-bias-limit")
    u = torch.randn(1, 7, m.d_model, dtype=torch.float64)
    u[0, 4, 0] = float("inf")
    cu = torch.tensor([0, 5, 7], dtype=torch.int32)
    seq = torch.tensor([[0] * 5 + [1] * 2], dtype=torch.int32)
    nxt = torch.randn(2, 1, m.d_model, dtype=torch.float64)
    params = InferenceParams(max_seqlen=8, max_batch_size=2)
    m(u, seq_idx=seq, cu_seqlens=cu, inference_params=params)
    conv_state, ssm_state = params.key_value_memory_dict[0]
    assert conv_state[1].isfinite().all() and ssm_state[1].isfinite().all()
    params.seqlen_offset = 7
    step = m(nxt, inference_params=params)
    alone = m(torch.cat([u[:, 5:7], nxt[1:2]], 1))
    assert rel(step[1, 0], alone[0, 2]) < STEP_TOL


@pytest.mark.parametrize("cu", [[0, 5, 9], [0, 5, 6], [2, 7], [0, 7, 5, 7]])
def test_varlen_prefill_refuses_bad_cu_seqlens_before_the_cache(cu):
    """cu_seqlens must run from 0 to seqlen, non-decreasing: a ValueError naming it, and
    the cache untouched."""
    m = make("mlp-Dp-groups-bias-limit")
    params = InferenceParams(max_seqlen=8, max_batch_size=len(cu) - 1)
    conv_state, ssm_state = m._get_states_from_cache(params, len(cu) - 1)
    conv_state.fill_(3.0)
    with pytest.raises(ValueError, match="cu_seqlens"):
        m(torch.randn(1, 7, m.d_model, dtype=torch.float64), cu_seqlens=torch.tensor(cu),
          inference_params=params)
    assert (conv_state == 3.0).all()


def test_decode_without_a_token_names_its_shape():
    """A decode call (seqlen_offset > 0) with no token gets the one-token error, not a
    reshape error from inside the module."""
    m = make("mlp-Dp-groups-bias-limit")
    params = InferenceParams(max_seqlen=8, max_batch_size=2)
    m(torch.randn(2, 3, m.d_model, dtype=torch.float64), inference_params=params)
    params.seqlen_offset = 3
    with pytest.raises(ValueError, match=r"\(batch, 1, d_model\)"):
        m(torch.randn(2, 0, m.d_model, dtype=torch.float64), inference_params=params)


def test_empty_flattened_input():
    """The (batch * seqlen, d_model) form with no rows: an empty output of that form."""
    m = make("mlp-Dp-groups-bias-limit")
    out = m(torch.randn(0, m.d_model, dtype=torch.float64), seqlen=4)
    assert out.shape == (0, m.d_model)


def test_step_with_allocated_cache_from_zero():
    """step from an empty cache is the forward from token 0."""
    m = make("mlp-Dp-groups-bias-limit")
    u = torch.randn(2, 6, m.d_model, dtype=torch.float64)
    conv_state, ssm_state = m.allocate_inference_cache(2, 6)
    assert conv_state.stride(1) == 1          # channel-last, as mamba_ssm allocates it
    outs = []
    for t in range(6):
        y, conv_state, ssm_state = m.step(u[:, t:t + 1], conv_state, ssm_state)
        outs.append(y)
    assert rel(torch.cat(outs, 1), m(u)) < F64_TOL


def test_varlen_prefill_states_per_sequence():
    """A packed prefill (batch 1, cu_seqlens, seq_idx) stores each sequence's conv and ssm
    states: equal to those of a separate prefill of that sequence."""
    m = make("mlp-Dp-groups-bias-limit")
    lens = [5, 1, 9]
    cu = torch.tensor([0, 5, 6, 15], dtype=torch.int32)
    seq = torch.repeat_interleave(torch.arange(3, dtype=torch.int32), torch.tensor(lens))[None]
    u = torch.randn(1, 15, m.d_model, dtype=torch.float64)
    params = InferenceParams(max_seqlen=15, max_batch_size=3)
    packed = m(u, seq_idx=seq, cu_seqlens=cu, inference_params=params)
    assert rel(packed, m(u, seq_idx=seq)) < F64_TOL
    conv_state, ssm_state = params.key_value_memory_dict[0]
    for s in range(3):
        one = InferenceParams(max_seqlen=15, max_batch_size=1)
        m(u[:, cu[s]:cu[s + 1]], inference_params=one)
        c1, s1 = one.key_value_memory_dict[0]
        torch.testing.assert_close(conv_state[s], c1[0], rtol=0, atol=1e-14)  # in_proj rounding
        torch.testing.assert_close(ssm_state[s], s1[0], rtol=STATE_TOL, atol=STATE_TOL)


def _expected_state_dict_shapes(d_model, d_state=128, d_conv=4, expand=2, headdim=64, d_ssm=None,
                                ngroups=1, D_has_hdim=False, rmsnorm=True, bias=False,
                                conv_bias=True, **_):
    """mamba_ssm Mamba2's parameters, from its constructor's semantics."""
    d_inner = expand * d_model
    d_ssm = d_inner if d_ssm is None else d_ssm
    nheads = d_ssm // headdim
    conv_dim = d_ssm + 2 * ngroups * d_state
    shapes = {"in_proj.weight": (2 * d_inner + 2 * ngroups * d_state + nheads, d_model),
              "conv1d.weight": (conv_dim, 1, d_conv), "dt_bias": (nheads,), "A_log": (nheads,),
              "D": (d_ssm if D_has_hdim else nheads,), "out_proj.weight": (d_model, d_inner)}
    if bias:
        shapes["in_proj.bias"] = (shapes["in_proj.weight"][0],)
        shapes["out_proj.bias"] = (d_model,)
    if conv_bias:
        shapes["conv1d.bias"] = (conv_dim,)
    if rmsnorm:
        shapes["norm.weight"] = (d_ssm,)
    return shapes


@pytest.mark.parametrize("kw", [dict(d_model=64), dict(CONFIGS["mlp-Dp-groups-bias-limit"]),
                                dict(CONFIGS["no-norm"])], ids=["default", "mlp", "no-norm"])
def test_mamba_ssm_state_dict_loads(kw):
    shapes = _expected_state_dict_shapes(**kw)
    m = Mamba2(**kw)
    assert {k: tuple(v.shape) for k, v in m.state_dict().items()} == shapes
    gen = torch.Generator().manual_seed(0)
    sd = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    m.load_state_dict(sd, strict=True)
    for k, v in m.state_dict().items():
        torch.testing.assert_close(v, sd[k], rtol=0, atol=0)


def test_initialisation_follows_mamba_ssm():
    m = Mamba2(d_model=64, dt_min=0.01, dt_max=0.05, A_init_range=(2, 4), conv_init=0.1)
    dt = F.softplus(m.dt_bias)
    assert ((dt > 0.01 - 1e-6) & (dt < 0.05 + 1e-6)).all()
    A = torch.exp(m.A_log)
    assert ((A >= 2) & (A <= 4)).all()
    assert (m.D == 1).all() and m.D.dtype == torch.float32
    assert (m.norm.weight == 1).all() and m.conv1d.weight.abs().max() <= 0.1
    assert m.dt_bias._no_weight_decay and m.A_log._no_weight_decay and m.D._no_weight_decay
    assert m.norm.group_size == m.d_ssm // m.ngroups and m.norm.eps == 1e-5


def test_torch_compile_fullgraph_training_step():
    m = make("mlp-Dp-groups-bias-limit", dtype=torch.float32)
    u = torch.randn(2, 30, m.d_model)

    def loss(u):
        return (m(u) ** 2).sum()
    eager = torch.autograd.grad(loss(u), list(m.parameters()))
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(u), list(m.parameters()))
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b)
    explain = torch._dynamo.explain(loss)(u)
    assert explain.graph_break_count == 0


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="process_group"):
        Mamba2(d_model=16, headdim=4, d_state=8, process_group=object())
    with pytest.raises(ValueError, match="d_ssm"):
        Mamba2(d_model=16, headdim=5, d_state=8)
    with pytest.raises(ValueError, match="ngroups"):
        Mamba2(d_model=16, headdim=4, d_state=8, ngroups=3)
    m = make("default-small", layer_idx=None)
    with pytest.raises(ValueError, match="layer_idx"):
        m(torch.randn(1, 4, 16, dtype=torch.float64),
          inference_params=InferenceParams(max_seqlen=4, max_batch_size=1))
    with pytest.raises(ValueError, match="hidden_states"):
        m.step(torch.randn(1, 2, 16, dtype=torch.float64), *m.allocate_inference_cache(1, 4))
    with pytest.raises(ValueError, match="d_model"):
        m(torch.randn(1, 4, 15, dtype=torch.float64))
    with pytest.raises(ValueError, match="u must have shape"):
        m(torch.randn(4, 16, dtype=torch.float64))
    conv_state, ssm_state = m.allocate_inference_cache(1, 4)
    with pytest.raises(ValueError, match="ssm_state must have shape"):
        m.step(torch.randn(1, 1, 16, dtype=torch.float64), conv_state, ssm_state[..., :-1])


@pytest.mark.parametrize("fused", [True, False])
def test_no_tokens(fused):
    """seqlen 0 gives an empty output on both paths, and an empty prefill leaves zero states."""
    m = make("default-small", use_mem_eff_path=fused)
    u = torch.randn(2, 0, 16, dtype=torch.float64)
    assert m(u).shape == (2, 0, 16)
    params = InferenceParams(max_seqlen=4, max_batch_size=2)
    assert m(u, inference_params=params).shape == (2, 0, 16)
    conv_state, ssm_state = params.key_value_memory_dict[m.layer_idx]
    assert not conv_state.any() and not ssm_state.any()


def test_sizes_from_numpy_and_tensor_integers():
    """A config's numpy or 0-d tensor integers build the same module as Python ints."""
    np = pytest.importorskip("numpy")
    torch.manual_seed(0)
    a = Mamba2(16, d_state=np.int64(8), headdim=np.int32(4), ngroups=np.int64(2),
               chunk_size=torch.tensor(64), dtype=torch.float64)
    torch.manual_seed(0)
    b = Mamba2(16, d_state=8, headdim=4, ngroups=2, chunk_size=64, dtype=torch.float64)
    assert type(a.ngroups) is int and type(a.chunk_size) is int
    u = torch.randn(1, 9, 16, dtype=torch.float64)
    torch.testing.assert_close(a(u), b(u), rtol=0, atol=0)
    with pytest.raises(TypeError, match="d_state"):
        Mamba2(16, d_state=8.5, headdim=4)
