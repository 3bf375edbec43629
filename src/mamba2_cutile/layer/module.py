"""`Mamba2`, the Mamba-2 mixer layer, with mamba_ssm 2.3.2's constructor, parameter names,
shapes and initialisation (`in_proj`, `conv1d`, `dt_bias`, `A_log`, `D`, `norm`, `out_proj`), so
a mamba_ssm `Mamba2` state dict loads as is.

- Training / plain forward: `mamba_split_conv1d_scan_combined` (one autograd node after the
  input projection); with `use_mem_eff_path=False` the parts one by one (convolution, scan,
  norm), each differentiable.
- Inference (`inference_params`, anything with `key_value_memory_dict` and `seqlen_offset`,
  such as `InferenceParams` here or mamba_ssm's): a prefill (seqlen_offset == 0) stores the
  convolution's last `d_conv` inputs and the scan's final state in the cache under
  `layer_idx`; later calls run `step` (one token) and update the cache in place. A varlen
  prefill (cu_seqlens, batch 1) stores one state per sequence.
- `step` runs `causal_conv1d_update` and `selective_state_update`; it applies `dt_limit`
  (mamba_ssm's step leaves it out, so its decode differs from its forward when dt_limit is set).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..checks import check_cu_seqlens, plain_int, value_checks_enabled
from ..conv1d import causal_conv1d_fn, causal_conv1d_update
from ..decode import selective_state_update
from ..norm import RMSNorm
from ..ssd import mamba_chunk_scan_combined
from .fused import mamba_split_conv1d_scan_combined

_NO_LIMIT = (0.0, float("inf"))


@dataclass
class InferenceParams:
    """The inference cache `Mamba2.forward` reads: per layer_idx a (conv_state, ssm_state)
    pair in `key_value_memory_dict`; `seqlen_offset` 0 means prefill, > 0 decode."""
    max_seqlen: int
    max_batch_size: int
    seqlen_offset: int = 0
    batch_size_offset: int = 0
    key_value_memory_dict: dict = field(default_factory=dict)
    lengths_per_sample: torch.Tensor | None = None

    def reset(self, max_seqlen, max_batch_size):
        self.max_seqlen, self.max_batch_size, self.seqlen_offset = max_seqlen, max_batch_size, 0
        if self.lengths_per_sample is not None:
            self.lengths_per_sample.zero_()


def conv_states_from_inputs(xBC, d_conv, cu_seqlens=None, seq_idx=None):
    """The convolution's cache after a prefill: the last d_conv inputs of each sequence, zero
    where the sequence is shorter. xBC (b, l, c) -> (b, c, d_conv): with seq_idx only the
    inputs of each row's last sequence (the one whose state the scan returns); with cu_seqlens
    (batch 1) one row per sequence, (num_seqs, c, d_conv). Reads no tensor values on the
    host."""
    if cu_seqlens is None:
        t = xBC.transpose(1, 2)
        l = t.shape[-1]
        t = F.pad(t, (d_conv - l, 0)) if l < d_conv else t[..., l - d_conv:]
        if seq_idx is not None and l:
            ids = seq_idx[:, max(0, l - d_conv):]
            same = F.pad(ids == ids[:, -1:], (d_conv - ids.shape[1], 0))       # (b, d_conv)
            t = torch.where(same[:, None, :], t, torch.zeros_like(t))
        return t
    cu = cu_seqlens.to(device=xBC.device, dtype=torch.long)
    start, end = cu[:-1, None], cu[1:, None]
    pos = end - d_conv + torch.arange(d_conv, device=xBC.device)       # (s, d_conv)
    rows = xBC[0][pos.clamp(min=0)]                                     # (s, d_conv, c)
    # selected, not multiplied: the positions before a sequence's start are another
    # sequence's inputs, which may hold NaN / Inf
    rows = torch.where((pos >= start)[..., None], rows, torch.zeros_like(rows))
    return rows.transpose(1, 2)


def _plain_int(name, v):
    """v as a Python int (numpy and 0-d tensor integers too); a clear error otherwise."""
    r = plain_int(v)
    if isinstance(r, bool) or not isinstance(r, int):
        raise TypeError(f"{name} must be an integer, got {type(v).__name__} {v!r}")
    return r


class Mamba2(nn.Module):
    """The Mamba-2 mixer of mamba_ssm (arguments and defaults as its `Mamba2`).

    `process_group` (tensor parallelism) is not supported and raises; `sequence_parallel`
    and `layer_idx` are kept as attributes.
    """

    def __init__(self, d_model, d_state=128, d_conv=4, conv_init=None, expand=2, headdim=64,
                 d_ssm=None, ngroups=1, A_init_range=(1, 16), D_has_hdim=False, rmsnorm=True,
                 norm_before_gate=False, dt_min=0.001, dt_max=0.1, dt_init_floor=1e-4,
                 dt_limit=(0.0, float("inf")), bias=False, conv_bias=True, chunk_size=256,
                 use_mem_eff_path=True, layer_idx=None, process_group=None,
                 sequence_parallel=True, device=None, dtype=None):
        if process_group is not None:
            raise ValueError("process_group: tensor-parallel Mamba2 is not supported by "
                             "mamba2_cutile; pass process_group=None")
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        # sizes from a config may be numpy or 0-d tensor integers: plain ints from here on
        # (they become kernel constants)
        d_model, d_state, d_conv, headdim, ngroups, chunk_size = (
            _plain_int(name, v) for name, v in (
                ("d_model", d_model), ("d_state", d_state), ("d_conv", d_conv),
                ("headdim", headdim), ("ngroups", ngroups), ("chunk_size", chunk_size)))
        d_ssm = None if d_ssm is None else _plain_int("d_ssm", d_ssm)
        self.d_model, self.d_state, self.d_conv, self.conv_init = d_model, d_state, d_conv, conv_init
        self.expand = expand
        self.process_group, self.sequence_parallel = None, sequence_parallel
        self.world_size, self.local_rank = 1, 0
        self.d_inner = expand * d_model
        self.headdim = headdim
        self.d_ssm = self.d_inner if d_ssm is None else d_ssm
        self.ngroups = ngroups
        if self.d_ssm % headdim:
            raise ValueError(f"d_ssm ({self.d_ssm}) must be a multiple of headdim ({headdim})")
        if self.d_ssm > self.d_inner:
            raise ValueError(f"d_ssm ({self.d_ssm}) must be at most d_inner = expand * d_model "
                             f"({self.d_inner})")
        self.nheads = self.d_ssm // headdim
        if ngroups < 1 or self.nheads % ngroups:
            raise ValueError(f"ngroups ({ngroups}) must divide nheads ({self.nheads})")
        self.D_has_hdim, self.rmsnorm, self.norm_before_gate = D_has_hdim, rmsnorm, norm_before_gate
        self.dt_limit = tuple(dt_limit)
        self.activation = "silu"
        self.chunk_size, self.use_mem_eff_path, self.layer_idx = chunk_size, use_mem_eff_path, layer_idx

        # [z0, x0 (d_mlp each) | z | x, B, C | dt]
        d_in_proj = 2 * self.d_inner + 2 * ngroups * d_state + self.nheads
        self.in_proj = nn.Linear(d_model, d_in_proj, bias=bias, **factory_kwargs)
        conv_dim = self.d_ssm + 2 * ngroups * d_state
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, kernel_size=d_conv, groups=conv_dim,
                                padding=d_conv - 1, bias=conv_bias, **factory_kwargs)
        if conv_init is not None:
            nn.init.uniform_(self.conv1d.weight, -conv_init, conv_init)
        self.act = nn.SiLU()

        # dt_bias = softplus^-1(dt), dt log-uniform in [dt_min, dt_max], at least dt_init_floor
        dt = torch.exp(torch.rand(self.nheads, **factory_kwargs)
                       * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = torch.clamp(dt, min=dt_init_floor)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.dt_bias._no_weight_decay = True
        if not (A_init_range[0] > 0 and A_init_range[1] >= A_init_range[0]):
            raise ValueError(f"A_init_range must satisfy 0 < low <= high, got {A_init_range}")
        A = torch.empty(self.nheads, dtype=torch.float32, device=device).uniform_(*A_init_range)
        self.A_log = nn.Parameter(torch.log(A).to(dtype=dtype))
        self.A_log._no_weight_decay = True
        # float32 whatever the module's dtype, as in mamba_ssm
        self.D = nn.Parameter(torch.ones(self.d_ssm if D_has_hdim else self.nheads,
                                         device=device))
        self.D._no_weight_decay = True
        if rmsnorm:
            self.norm = RMSNorm(self.d_ssm, eps=1e-5, norm_before_gate=norm_before_gate,
                                group_size=self.d_ssm // ngroups, **factory_kwargs)
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=bias, **factory_kwargs)

    # --- pieces ---------------------------------------------------------------------------

    @property
    def d_mlp(self):
        return self.d_inner - self.d_ssm

    def _split(self, zxbcdt):
        """z0, x0, z, xBC, dt along the last dimension."""
        n = self.ngroups * self.d_state
        return torch.split(zxbcdt, [self.d_mlp, self.d_mlp, self.d_ssm, self.d_ssm + 2 * n,
                                    self.nheads], dim=-1)

    def _D(self):
        return self.D.view(self.nheads, self.headdim) if self.D_has_hdim else self.D

    def _A(self):
        # float32 even for a half-precision module (A would underflow to -inf otherwise)
        return -torch.exp(self.A_log.float())

    def _conv_weight(self):
        return self.conv1d.weight[:, 0, :]

    def _finish(self, y, z, z0, x0):
        """Norm (or nothing: z gated inside the scan), the SwiGLU branch, out projection."""
        if self.rmsnorm:
            y = self.norm(y, z)
        if self.d_mlp > 0:
            y = torch.cat([F.silu(z0) * x0, y], dim=-1)
        return self.out_proj(y)

    # --- forward ---------------------------------------------------------------------------

    def forward(self, u, seqlen=None, seq_idx=None, cu_seqlens=None, inference_params=None):
        """u (batch, seqlen, d_model), or (batch * seqlen, d_model) with `seqlen` given;
        returns u's shape. seq_idx (batch, seqlen) int marks packed sequences; cu_seqlens
        (num_seqs + 1,) is read only for a varlen prefill into `inference_params`."""
        if u.dim() != (2 if seqlen is not None else 3):
            raise ValueError(f"u must have shape (batch, seqlen, d_model), or (batch * seqlen, "
                             f"d_model) with seqlen given, got {tuple(u.shape)}")
        if u.shape[-1] != self.d_model:
            raise ValueError(f"u's last dimension must be d_model = {self.d_model}, got "
                             f"{u.shape[-1]}")
        seqlen_og = seqlen
        if seqlen is None:
            batch, seqlen = u.shape[:2]
        else:
            if u.shape[0] % seqlen:
                raise ValueError(f"u's first dimension ({u.shape[0]}) must be batch * seqlen "
                                 f"with seqlen = {seqlen}")
            batch = u.shape[0] // seqlen
        conv_state = ssm_state = None
        if inference_params is not None and cu_seqlens is not None:
            # checked before the cache is touched
            if batch != 1:
                raise ValueError(f"cu_seqlens (a varlen prefill into inference_params) needs u "
                                 f"of batch 1 (the sequences packed along seqlen), got batch "
                                 f"{batch}")
            check_cu_seqlens(cu_seqlens, seqlen, value_checks_enabled(u.is_cuda))
        if inference_params is not None:
            cache_batch = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else batch
            conv_state, ssm_state = self._get_states_from_cache(inference_params, cache_batch)
            if inference_params.seqlen_offset > 0:
                out, _, _ = self.step(u.view(batch, seqlen, u.shape[-1]), conv_state,
                                      ssm_state)
                return out.view(u.shape[0], out.shape[-1]) if seqlen_og is not None else out
        zxbcdt = self.in_proj(u)
        if seqlen_og is not None:
            zxbcdt = zxbcdt.view(batch, seqlen, zxbcdt.shape[-1])
        varlen_prefill = inference_params is not None and cu_seqlens is not None
        # no tokens: the fused function's empty result (the parts' convolution needs one)
        if (self.use_mem_eff_path or seqlen == 0) and not varlen_prefill:
            out = self._forward_fused(zxbcdt, seq_idx, conv_state, ssm_state)
        else:
            out = self._forward_parts(zxbcdt, seq_idx, cu_seqlens if varlen_prefill else None,
                                      conv_state, ssm_state)
        return out.view(batch * seqlen, out.shape[-1]) if seqlen_og is not None else out

    def _forward_fused(self, zxbcdt, seq_idx, conv_state, ssm_state):
        out = mamba_split_conv1d_scan_combined(
            zxbcdt, self._conv_weight(), self.conv1d.bias, self.dt_bias, self._A(), self._D(),
            self.chunk_size, seq_idx=seq_idx, dt_limit=self.dt_limit,
            return_final_states=ssm_state is not None, activation=self.activation,
            rmsnorm_weight=self.norm.weight if self.rmsnorm else None,
            rmsnorm_eps=self.norm.eps if self.rmsnorm else 1e-6,
            outproj_weight=self.out_proj.weight, outproj_bias=self.out_proj.bias,
            headdim=None if self.D_has_hdim else self.headdim, ngroups=self.ngroups,
            norm_before_gate=self.norm_before_gate)
        if ssm_state is not None:
            out, final = out
            ssm_state.copy_(final)
            xBC = self._split(zxbcdt)[3]
            conv_state.copy_(conv_states_from_inputs(xBC, self.d_conv, seq_idx=seq_idx))
        return out

    def _forward_parts(self, zxbcdt, seq_idx, cu_seqlens, conv_state, ssm_state):
        """The layer part by part (each differentiable): convolution, scan, norm. With
        cu_seqlens (a varlen prefill) the cache gets one state per sequence."""
        z0, x0, z, xBC, dt = self._split(zxbcdt)
        if conv_state is not None:
            conv_state.copy_(conv_states_from_inputs(xBC, self.d_conv, cu_seqlens,
                                                     None if cu_seqlens is not None else seq_idx))
        xBC = causal_conv1d_fn(xBC.transpose(1, 2), self._conv_weight(), self.conv1d.bias,
                         seq_idx=seq_idx, activation=self.activation).transpose(1, 2)
        x, B, C = torch.split(xBC, [self.d_ssm, self.ngroups * self.d_state,
                                    self.ngroups * self.d_state], dim=-1)
        heads = lambda t: t.unflatten(-1, (self.nheads, self.headdim))  # noqa: E731
        groups = lambda t: t.unflatten(-1, (self.ngroups, self.d_state))  # noqa: E731
        res = mamba_chunk_scan_combined(
            heads(x), dt, self._A(), groups(B), groups(C), self.chunk_size, D=self._D(),
            z=None if self.rmsnorm else heads(z), dt_bias=self.dt_bias, dt_softplus=True,
            seq_idx=seq_idx, cu_seqlens=cu_seqlens, dt_limit=self.dt_limit,
            return_final_states=ssm_state is not None,
            return_varlen_states=cu_seqlens is not None)
        if ssm_state is not None:
            y, final, *varlen = res
            ssm_state.copy_(varlen[0] if cu_seqlens is not None else final)
        else:
            y = res
        return self._finish(y.flatten(-2), z, z0, x0)

    # --- decode ----------------------------------------------------------------------------

    def step(self, hidden_states, conv_state, ssm_state):
        """One token: hidden_states (batch, 1, d_model); conv_state (batch, conv_dim, d_conv)
        and ssm_state (batch, nheads, headdim, d_state) are updated in place. Returns
        (out (batch, 1, d_model), conv_state, ssm_state)."""
        if hidden_states.dim() != 3 or hidden_states.shape[1] != 1:
            raise ValueError(f"hidden_states must have shape (batch, 1, d_model) (one token "
                             f"per step), got {tuple(hidden_states.shape)}")
        b = hidden_states.shape[0]
        want = (b, self.nheads, self.headdim, self.d_state)
        if not isinstance(ssm_state, torch.Tensor) or tuple(ssm_state.shape) != want:
            got = tuple(ssm_state.shape) if isinstance(ssm_state, torch.Tensor) else ssm_state
            raise ValueError(f"ssm_state must have shape (batch, nheads, headdim, d_state) = "
                             f"{want}, got {got}")
        zxbcdt = self.in_proj(hidden_states[:, 0])
        z0, x0, z, xBC, dt = self._split(zxbcdt)
        xBC = causal_conv1d_update(xBC, conv_state, self._conv_weight(), self.conv1d.bias,
                                activation=self.activation)
        x, B, C = torch.split(xBC, [self.d_ssm, self.ngroups * self.d_state,
                                    self.ngroups * self.d_state], dim=-1)
        h, p, n = self.nheads, self.headdim, self.d_state
        dt_bias, softplus = self.dt_bias, True
        if self.dt_limit != _NO_LIMIT:
            # the decode kernel has no clamp: apply softplus, bias and limits here
            cd = torch.promote_types(dt.dtype, torch.float32)
            dt = F.softplus(dt.to(cd) + dt_bias.to(cd)).clamp(*self.dt_limit)
            dt_bias, softplus = None, False
        y = selective_state_update(
            ssm_state, x.view(b, h, p), dt[..., None].expand(b, h, p),
            self._A()[:, None, None].expand(h, p, n), B.view(b, self.ngroups, n),
            C.view(b, self.ngroups, n), D=self._D(),
            z=None if self.rmsnorm else z.view(b, h, p),
            dt_bias=None if dt_bias is None else dt_bias[:, None].expand(h, p),
            dt_softplus=softplus)
        out = self._finish(y.reshape(b, self.d_ssm), z, z0, x0)
        return out.unsqueeze(1), conv_state, ssm_state

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None, **kwargs):
        """Zero (conv_state (batch, conv_dim, d_conv), channel-last in memory as mamba_ssm's,
        ssm_state (batch, nheads, headdim, d_state)); dtype default: the conv weight's and the
        in_proj weight's."""
        device = self.out_proj.weight.device
        conv_dtype = self.conv1d.weight.dtype if dtype is None else dtype
        conv_state = torch.zeros(batch_size, self.d_conv, self.conv1d.weight.shape[0],
                                 device=device, dtype=conv_dtype).transpose(1, 2)
        ssm_dtype = self.in_proj.weight.dtype if dtype is None else dtype
        ssm_state = torch.zeros(batch_size, self.nheads, self.headdim, self.d_state,
                                device=device, dtype=ssm_dtype)
        return conv_state, ssm_state

    def _get_states_from_cache(self, inference_params, batch_size, initialize_states=False):
        if self.layer_idx is None:
            raise ValueError("layer_idx: Mamba2 needs a layer_idx to use inference_params")
        cache = inference_params.key_value_memory_dict
        if self.layer_idx not in cache:
            conv_state = torch.zeros(batch_size, self.d_conv, self.conv1d.weight.shape[0],
                                     device=self.conv1d.weight.device,
                                     dtype=self.conv1d.weight.dtype).transpose(1, 2)
            ssm_state = torch.zeros(batch_size, self.nheads, self.headdim, self.d_state,
                                    device=self.in_proj.weight.device,
                                    dtype=self.in_proj.weight.dtype)
            cache[self.layer_idx] = (conv_state, ssm_state)
        else:
            conv_state, ssm_state = cache[self.layer_idx]
            if initialize_states:
                conv_state.zero_()
                ssm_state.zero_()
        return conv_state, ssm_state
