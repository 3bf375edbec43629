"""The backward pass of the chunked SSD as explicit formulas (no autograd): the blueprint for the
cuTile backward kernels.

Notation, per (batch, head) and chunk c of Q tokens (i, j, s index tokens inside the chunk;
the last chunk is zero-padded to Q tokens: x = B = C = dt' = 0 and dy = 0 there, seq id = the
last real token's, so every padded quantity contributes nothing and G_last = G_{Q-1} is the
cumulative decay at the last real token):

    a_t      = A * dt'_t                           (dt' the preprocessed dt, see stage 6)
    G_i      = sum_{s <= i} a_s                    (natural log; the forward kernels store
                                                    log2(e) * G, so exp(G_i - G_j) is
                                                    exp2(G2_i - G2_j) there: the weights are the
                                                    same numbers and no ln 2 factor enters any
                                                    gradient below, which is w.r.t. natural G)
    G_l      = G_{Q-1}                             (the chunk's total decay)
    M_ij     = [j <= i] * [seq_i == seq_j]         (causal, same-sequence mask)
    L_ij     = exp(G_i - G_j) if M_ij else 0       (exponent masked to -inf *before* exp)
    S_ij     = C_i . B_j                           (Q x Q, per head; B, C of the head's group)
    s_i      = [seq_i == seq of the token before the chunk]   (token sees the carried state;
                                                    chunk 0: the row's first seq id)
    u_j      = [seq_j == seq of the chunk's last token]       (token reaches the exit state)
    r_c      = [seq of chunk's last token == seq before the chunk]   (carry survives chunk)

Forward (what we differentiate), h_c = the state entering chunk c (h_0 = initial_states):

    y_i      = sum_j L_ij S_ij dt_j x_j  +  s_i exp(G_i) C_i h_c^T                 (Q x P)
    h_{c+1}  = r_c exp(G_l) h_c  +  sum_j u_j exp(G_l - G_j) dt_j x_j (outer) B_j   (P x N)
    out      = (y + D * x) * silu(z)
    final    = h_{num_chunks}

Backward, with dS_c := dLoss/dh_{c+1} (the gradient at chunk c's EXIT state) and
dY = dLoss/dy (after the gate):

    stage 1  recompute dt', G (decay_cumsum), entry states h_c (chunk_state_pass), and, only
             when z is given, the pre-gate y (chunk_scan without the gate)
    stage 2  gate / skip:   dY = dout * silu(z);  dz = dout * (y + D x) * silu'(z);
             dD = sum dY * x;  dx += D * dY
    stage 3  reverse sequential pass over chunks (the adjoint of the state recurrence):
             dS_{last} = dfinal;  dh_c = r_c exp(G_l) dS_c + sum_i s_i exp(G_i) dY_i^T C_i;
             dS_{c-1} = dh_c;  dinitial_states = dh_0
    stage 4  per chunk, in parallel: dx, ddt (direct part), dB, dC, and the gradient of the
             per-token decays da_s = dLoss/da_s (all terms, already reduced over the chunk)
    stage 5  ddt' = A * da + ddt_direct;  dA = sum dt' * da
    stage 6  chain ddt' through the dt_limit clamp, softplus and dt_bias: ddt, ddt_bias

Everything a stage holds per program is a per-chunk tile: Q x Q (S, dY X^T, L), Q x P (x, dY),
Q x N (B, C), P x N (h_c, dS_c), and Q-vectors (dt', G, masks). Nothing of size l x l. The
PyTorch below batches all chunks at once (tensors shaped (b, h, nc, Q, ...)) where the stage is
parallel over chunks, and loops over chunks where it is sequential.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .common import autocast_off, expand_groups

INF = float("inf")
#: decay_cumsum's clamp of one token's log decay (2^256 in its log2 units), in natural log
MAX_LOG_STEP = 256.0 * math.log(2.0)
SOFTPLUS_THRESHOLD = 20.0     # torch's F.softplus default (beta = 1)


# ----------------------------------------------------------------------------------------------
# layout helpers (what the kernels get from TMA loads with zero padding)
# ----------------------------------------------------------------------------------------------

def to_chunks(t, Q, nc):
    """(b, l, h, ...) -> (b, h, nc, Q, ...), zero-padded to nc * Q tokens."""
    b, l = t.shape[:2]
    t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, nc * Q - l))
    return t.reshape(b, nc, Q, *t.shape[2:]).movedim(3, 1)


def from_chunks(t, l):
    """(b, h, nc, Q, ...) -> (b, l, h, ...), dropping the padding."""
    b, h, nc, Q = t.shape[:4]
    return t.movedim(1, 3).reshape(b, nc * Q, h, *t.shape[4:])[:, :l]


def sum_groups(t, ngroups):
    """(b, l, h, n) -> (b, l, g, n): the gradient of a group's B or C is the sum over its heads."""
    b, l, h, n = t.shape
    return t.reshape(b, l, ngroups, h // ngroups, n).sum(dim=3)


def sequence_masks(seq_idx, b, l, Q, nc, device):
    """The same-sequence masks of every chunk, from seq_idx (b, l) (None: one sequence per row).

    Returns (each broadcasting over heads, so with a head axis of size 1):
        same    (b, 1, nc, Q, Q) bool   M_ij = [j <= i] & [seq_i == seq_j]
        carried (b, 1, nc, Q)    bool   s_i  = [seq_i == seq before the chunk]
        in_last (b, 1, nc, Q)    bool   u_j  = [seq_j == seq of the chunk's last token]
        carry   (b, 1, nc)       bool   r_c  = [seq of last token == seq before the chunk]
    "Seq before the chunk" is seq[c*Q - 1] for c > 0 and seq[0] for chunk 0 (the initial state
    belongs to the row's first sequence). Padding repeats the last seq id. A kernel computes
    these on the fly from the (1, Q) seq_idx tile plus one or two scalars.
    """
    if seq_idx is None:
        seq = torch.zeros(b, l, dtype=torch.int64, device=device)
    else:
        seq = seq_idx.to(torch.int64)
    pad = nc * Q - l
    seqc = torch.cat([seq, seq[:, -1:].expand(b, pad)], dim=1).reshape(b, nc, Q)
    seq_last = seqc[:, :, -1]                                               # (b, nc)
    seq_before = torch.cat([seqc[:, :1, 0], seq_last[:, :-1]], dim=1)       # (b, nc)
    causal = torch.ones(Q, Q, dtype=torch.bool, device=device).tril()
    same = (seqc[:, :, :, None] == seqc[:, :, None, :]) & causal
    return dict(same=same[:, None],
                carried=(seqc == seq_before[:, :, None])[:, None],
                in_last=(seqc == seq_last[:, :, None])[:, None],
                carry=(seq_last == seq_before)[:, None])


def _masked_exp(mask, expo):
    """exp(expo) where mask else 0, masking the exponent first (never forms inf * 0)."""
    return torch.exp(torch.where(mask, expo, torch.full_like(expo, -INF)))


def _kept(mask, t):
    """t where mask else 0, by a select: a masked-out entry may be NaN (0 * NaN is NaN)."""
    return torch.where(mask, t, torch.zeros_like(t))


def _readable(*ts):
    """Whether the values of these tensors may steer Python: CPU tensors only (on a GPU a read
    is a host synchronization; traced, fake and meta tensors have no values), the others take
    the branch-free forms."""
    from torch._subclasses.fake_tensor import is_fake
    return not torch.compiler.is_compiling() and all(
        t is None or (t.device.type == "cpu" and not is_fake(t)) for t in ts)


def _all_finite(*ts):
    return all(t is None or bool(torch.isfinite(t).all()) for t in ts)


def _mm_kept(W, V, keep):
    """W @ V for W zero outside `keep` (.., Q, Q): a non-finite row of V reaches an output
    row only through a kept entry, where the recurrence meets it (NaN there), never through a
    masked-out 0 (the plain product's 0 * NaN)."""
    if _readable(V) and _all_finite(V):
        return W @ V
    bad = ~torch.isfinite(V)
    out = W @ torch.where(bad, torch.zeros_like(V), V)
    hits = keep.to(V.dtype) @ bad.to(V.dtype)
    return torch.where(hits > 0, torch.full_like(out, math.nan), out)


def intra_decay(G, same):
    """L_ij = exp(G_i - G_j) on the causal same-sequence mask, else 0.   (b, h, nc, Q, Q)"""
    return _masked_exp(same, G[..., :, None] - G[..., None, :])


def _weights(G, masks):
    """The per-token scalar weights shared by several stages, all (b, h, nc, Q) or (b, h, nc):
        state_w_i = s_i exp(G_i)            (carried-state term of y)
        exit_w_j  = u_j exp(G_l - G_j)      (a token's weight in the exit state, without dt)
        carry_w   = r_c exp(G_l)            (decay of the carried state across the chunk)
    """
    G_l = G[..., -1]
    state_w = _masked_exp(masks["carried"], G)
    exit_w = _masked_exp(masks["in_last"], G_l[..., None] - G)
    carry_w = _masked_exp(masks["carry"], G_l)
    return state_w, exit_w, carry_w


# ----------------------------------------------------------------------------------------------
# stage 1: recompute the forward quantities (what the forward kernels stored)
# ----------------------------------------------------------------------------------------------

def stage1_dt_and_decay(dt, A, Q, nc, dt_bias=None, dt_softplus=False, dt_limit=(0.0, INF)):
    """Kernel: decay_cumsum (parallel over chunks x head tiles). Reads dt (b, l, h), dt_bias,
    A; writes dt' and G in the [batch, head, token] layout (here (b, h, nc, Q)):

        v    = dt + dt_bias;   w = softplus(v) if dt_softplus else v
        dt'  = clamp(w, lo, hi)   (the default (0, inf) too, as mamba_ssm's Triton scan);
               0 on padding
        G    = cumsum_within_chunk(a),  a = A * dt' clamped to +-MAX_LOG_STEP, 0 where dt' = 0

    The step clamp is decay_cumsum's: A = -inf or dt' = +inf give a decay of exactly 0 (in
    float32; 2^-256 in float64) with G finite, so differences G_i - G_j never form
    -inf - -inf = NaN (which made dx, dB and dC of an A = -inf head NaN, where the recurrence
    has finite ones); a NaN step becomes -MAX_LOG_STEP (its NaN reaches the gradients through
    dt' itself), a NaN A stays NaN.

    The forward already stores exactly these two buffers (G as log2(e) * G): keep them.
    """
    v = dt if dt_bias is None else dt + dt_bias
    w = F.softplus(v) if dt_softplus else v
    dtp = w.clamp(min=dt_limit[0], max=dt_limit[1])
    dtp_c = to_chunks(dtp, Q, nc)                                           # (b, h, nc, Q)
    Ab = A[None, :, None, None]
    step = (Ab * dtp_c).nan_to_num(nan=-MAX_LOG_STEP).clamp(-MAX_LOG_STEP, MAX_LOG_STEP)
    step = torch.where(Ab.isnan(), Ab, step)
    G = torch.cumsum(torch.where(dtp_c == 0, torch.zeros_like(step), step), dim=-1)
    return dtp_c, G


def stage1_entry_states(x_c, B_c, dtp_c, G, masks, initial_states=None):
    """Kernel: chunk_state_pass (sequential over chunks, parallel over (b, h, P-tile, N-tile)).
    Reads per chunk x (Q x P), B (Q x N), dt', G, seq; writes h_c for every chunk and the final
    state:
        h_{c+1} = r_c exp(G_l) h_c + (X^T (P x Q)) @ (u exp(G_l - G) dt' * B (Q x N))

    The forward already writes h_c (in state dtype) and the final state: keep them (the
    backward then uses the same, possibly rounded, states the forward output used).
    Returns entry (b, h, nc, P, N), final (b, h, P, N).
    """
    b, h, nc, _, p = x_c.shape
    n = B_c.shape[-1]
    _, exit_w, carry_w = _weights(G, masks)
    # rows of tokens outside the chunk's last sequence, and a state that does not carry, are
    # selected away, not multiplied by 0: another sequence's NaN / Inf stays out
    last = masks["in_last"][..., None]
    wB = _kept(last, (exit_w * dtp_c)[..., None] * B_c)                     # (b, h, nc, Q, N)
    xs = _kept(last, x_c)
    if initial_states is None:
        state = x_c.new_zeros(b, h, p, n)
    else:
        state = initial_states
    entry = []
    for c in range(nc):
        entry.append(state)
        state = (_kept(masks["carry"][:, :, c, None, None],
                       carry_w[:, :, c, None, None] * state)
                 + xs[:, :, c].transpose(-1, -2) @ wB[:, :, c])
    return torch.stack(entry, dim=2), state


def stage1_pregate_output(x_c, B_c, C_c, dtp_c, G, L, masks, entry):
    """Kernel: chunk_scan without D and the gate (parallel over chunks), only needed when z is
    given (for dz). Per chunk:
        y = (L o S o dt'_j) @ X  +  state_w * (C @ h_c^T)            (Q x P)
    Alternatively the forward could store y + D x (b*l*h*p extra, what mamba_ssm does as out_x);
    recomputing it fuses naturally into the stage-2 kernel (same tiles as the forward).
    Returns y_c (b, h, nc, Q, P).
    """
    state_w, _, _ = _weights(G, masks)
    S = C_c @ B_c.transpose(-1, -2)                                         # (.., Q, Q)
    same = masks["same"]
    y = _mm_kept(_kept(same, L * S * dtp_c[..., None, :]), x_c, same)
    return y + _kept(masks["carried"][..., None],
                     state_w[..., None] * (C_c @ entry.transpose(-1, -2)))


# ----------------------------------------------------------------------------------------------
# stage 2: gate and skip
# ----------------------------------------------------------------------------------------------

def stage2_gate_skip(dout, x, y_ssm=None, D=None, z=None):
    """Kernel: elementwise per (Q x P) tile, fused with the stage-1 y recompute when z is given
    (parallel over chunks; dD is a per-program partial sum, reduced afterwards).
    Reads dout, x, z, D, y (pre-gate, pre-D, only with z). Writes dY, dz, dD and dx_skip:

        yD    = y + D x
        dY    = dout * silu(z)                 (dout without z)
        dz    = dout * yD * silu'(z),   silu'(z) = sig(z) (1 + z (1 - sig(z)))
        dD    = sum_{b, l, p} dY * x  (D per head)  or  sum_{b, l} dY * x  (D per channel)
        dx   += D * dY                         (the skip's share of dx)
    All (b, l, h, p) except dD.
    """
    dz = None
    if z is None:
        dy = dout
    else:
        sig = torch.sigmoid(z)
        dy = dout * z * sig
        yD = y_ssm if D is None else y_ssm + (D[:, None] if D.dim() == 1 else D) * x
        dz = dout * yD * sig * (1 + z * (1 - sig))
    dD, dx_skip = None, None
    if D is not None:
        prod = dy * x
        dD = prod.sum(dim=(0, 1, 3)) if D.dim() == 1 else prod.sum(dim=(0, 1))
        dx_skip = (D[:, None] if D.dim() == 1 else D) * dy
    return dy, dz, dD, dx_skip


# ----------------------------------------------------------------------------------------------
# stage 3: reverse pass over chunks (adjoint state recurrence)
# ----------------------------------------------------------------------------------------------

def stage3_reverse_state_pass(dy_c, C_c, G, masks, dfinal_states=None):
    """Kernel: the mirror of chunk_state_pass, running c = nc-1 .. 0 (sequential over chunks,
    parallel over (b, h, P-tile, N-tile)). Reads per chunk dY (Q x P), C (Q x N), G, seq;
    writes dS_c = dLoss/dh_{c+1} (the gradient at each chunk's EXIT state) for stage 4, and
    dinitial_states:

        dS_{nc-1} = dfinal_states (or 0)
        dh_c      = r_c exp(G_l) dS_c  +  (dY^T (P x Q)) @ (s exp(G) * C (Q x N))
        dS_{c-1}  = dh_c;      dinitial_states = dh_0

    The MMA term is parallel over chunks (it could be a separate kernel writing per-chunk
    contributions, then the sequential part is only the scalar-decay recurrence).
    Returns dS (b, h, nc, P, N), dinit (b, h, P, N).
    """
    b, h, nc, _, p = dy_c.shape
    n = C_c.shape[-1]
    state_w, _, carry_w = _weights(G, masks)
    # (selects, as in stage1_entry_states: tokens not carried in, a state that does not carry)
    carried = masks["carried"][..., None]
    wC = _kept(carried, state_w[..., None] * C_c)                           # (b, h, nc, Q, N)
    dys = _kept(carried, dy_c)
    dstate = dy_c.new_zeros(b, h, p, n) if dfinal_states is None else dfinal_states
    dS = [None] * nc
    for c in reversed(range(nc)):
        dS[c] = dstate
        dstate = (_kept(masks["carry"][:, :, c, None, None],
                        carry_w[:, :, c, None, None] * dstate)
                  + dys[:, :, c].transpose(-1, -2) @ wC[:, :, c])
    return torch.stack(dS, dim=2), dstate


# ----------------------------------------------------------------------------------------------
# stage 4: per-chunk gradients (parallel over chunks)
# ----------------------------------------------------------------------------------------------

def stage4_dx(x_c, dy_c, B_c, C_c, dtp_c, G, L, masks, dS):
    """Kernel (parallel over chunks x P-tiles): dx and the direct part of ddt'.
    Reads dY (Q x P), X (Q x P), B, C (Q x N), dt', G, seq, dS_c (P x N):

        dXs    = (L o S)^T @ dY  +  exit_w * (B @ dS_c^T)       (Q x P; S = C B^T, Q x Q)
        dx     = dt' * dXs                                      (+ D dY from stage 2)
        ddt_d  = rowsum(X o dXs)                                (Q; summed over P-tiles)

    (dt' multiplies x in both the intra-chunk and the chunk-state term, so the same tile
    gives both gradients with no division by dt'.)
    Returns dx_c (b, h, nc, Q, P), ddt_direct (b, h, nc, Q).
    """
    _, exit_w, _ = _weights(G, masks)
    S = C_c @ B_c.transpose(-1, -2)
    same_t = masks["same"].transpose(-1, -2)
    dXs = (_mm_kept(_kept(masks["same"], L * S).transpose(-1, -2), dy_c, same_t)
           + _kept(masks["in_last"][..., None], exit_w[..., None] * (B_c @ dS.transpose(-1, -2))))
    return dtp_c[..., None] * dXs, (x_c * dXs).sum(dim=-1)


def stage4_dC(x_c, dy_c, B_c, dtp_c, G, L, masks, entry):
    """Kernel (parallel over chunks x N-tiles; loops or atomics over the heads of a group).
    Reads dY, X (Q x P), B (Q x N), dt', G, seq, h_c (P x N):

        dC = (dY X^T o L o dt'_j) @ B  +  state_w * (dY @ h_c)            (Q x N)

    Returns dC per head (b, h, nc, Q, N); sum over the heads of each group afterwards.
    """
    state_w, _, _ = _weights(G, masks)
    dYX = dy_c @ x_c.transpose(-1, -2)                                      # (.., Q, Q)
    same = masks["same"]
    return (_mm_kept(_kept(same, dYX * L * dtp_c[..., None, :]), B_c, same)
            + _kept(masks["carried"][..., None], state_w[..., None] * (dy_c @ entry)))


def stage4_dB(x_c, dy_c, C_c, dtp_c, G, L, masks, dS):
    """Kernel (parallel over chunks x N-tiles; loops or atomics over the heads of a group).
    Reads dY, X (Q x P), C (Q x N), dt', G, seq, dS_c (P x N):

        dB = dt' * ( (dY X^T o L)^T @ C  +  exit_w * (X @ dS_c) )        (Q x N)

    Returns dB per head (b, h, nc, Q, N); sum over the heads of each group afterwards.
    """
    _, exit_w, _ = _weights(G, masks)
    dYX = dy_c @ x_c.transpose(-1, -2)
    same = masks["same"]
    intra = _mm_kept(_kept(same, dYX * L).transpose(-1, -2), C_c, same.transpose(-1, -2))
    return dtp_c[..., None] * (intra + _kept(masks["in_last"][..., None],
                                             exit_w[..., None] * (x_c @ dS)))


def _exclusive_cumsum(t):
    # a shift, not cumsum - t: a non-finite t_s must not reach its own entry (NaN - NaN)
    return F.pad(torch.cumsum(t, dim=-1)[..., :-1], (1, 0))


def _reverse_cumsum(t):
    return torch.flip(torch.cumsum(torch.flip(t, (-1,)), dim=-1), (-1,))


def stage4_ddecay(x_c, dy_c, B_c, C_c, dtp_c, G, L, masks, entry, dS, zero_start=False):
    """Kernel (parallel over chunks; P and N reductions inside): the gradient of the per-token
    decays a_s = A dt'_s, already reduced through the within-chunk cumsum G_i = sum_{s<=i} a_s,
    i.e. da_s = sum_{i >= s} dG_i. Reads dY, X (Q x P), B, C (Q x N), dt', G, seq, h_c and dS_c
    (P x N). Four terms, each written so that no two large equal terms cancel:

      intra:  W_ij = L_ij S_ij dt'_j (dY_i . X_j)  (Q x Q; dG_i += rowsum W, dG_j -= colsum W)
              da_s += sum_{i >= s} sum_{j < s} W_ij
                    = sum_i [i >= s] Excl_ij  with Excl = exclusive cumsum of W along j
              (the diagonal never contributes; mamba_ssm's "stable" ddA form)
      exit:   V_j  = exit_w_j dt'_j (X_j . (dS_c B_j))  (dG_l += sum V, dG_j -= V_j)
              da_s += sum_{j < s} V_j                    (exclusive cumsum)
      carry:  da_s += r_c exp(G_l) <dS_c, h_c>_F         (same for every s of the chunk)
      state:  dG_i  = state_w_i (dY_i . (C h_c^T)_i)
              da_s += sum_{i >= s} dG_i                  (reverse cumsum)

    (The unstable equivalent: dG = rowsum(C o dC) - rowsum(B o dB) + carry at the last token,
    then a reverse cumsum: the intra part subtracts nearly equal sums in fp32.)
    The carry and state terms are selected to 0 where their mask (r_c, s_i) is off, and
    with `zero_start` (no initial state) on the first chunk, rather than multiplied by a 0
    weight or a zero h_c: an Inf in dY or dS_c there would make them NaN. There the true
    term is absent: a packed sequence starts from a reset state (the recurrence selects
    the previous one away), and the row's first chunk decays a zero state (the recurrence
    forms decay * 0, so its autograd gives NaN where this gives the finite limit).
    Returns da (b, h, nc, Q); the entries at padding tokens are unused.
    """
    state_w, exit_w, carry_w = _weights(G, masks)
    Q = G.shape[-1]
    S = C_c @ B_c.transpose(-1, -2)
    W = _kept(masks["same"], L * S * dtp_c[..., None, :] * (dy_c @ x_c.transpose(-1, -2)))
    row_ge = torch.ones(Q, Q, dtype=torch.bool, device=G.device).tril()  # [i >= s]
    da = _kept(row_ge, _exclusive_cumsum(W)).sum(dim=-2)
    V = _kept(masks["in_last"], exit_w * dtp_c * ((x_c @ dS) * B_c).sum(dim=-1))
    da = da + _exclusive_cumsum(V)
    carry_on, state_on = masks["carry"][..., None], masks["carried"]
    if zero_start:
        has_entry = (torch.arange(G.shape[-2], device=G.device) > 0)[:, None]
        carry_on, state_on = carry_on & has_entry, state_on & has_entry
    carry = _kept(carry_on, (carry_w * (dS * entry).sum(dim=(-1, -2)))[..., None])
    dG_state = _kept(state_on, state_w * (dy_c * (C_c @ entry.transpose(-1, -2))).sum(dim=-1))
    return da + carry + _reverse_cumsum(dG_state)


# ----------------------------------------------------------------------------------------------
# stages 5 and 6: decays to dt' and A, then through the dt preprocessing
# ----------------------------------------------------------------------------------------------

def stage5_decay_to_dt_A(da, ddt_direct, dtp_c, A):
    """Elementwise (fused into stage 4's epilogue in a kernel; dA as per-program partial sums).
        ddt' = A * da + ddt_direct          (b, h, nc, Q)
        dA   = sum_{b, chunks, tokens} dt' * da      (h,)
    """
    ddtp = A[None, :, None, None] * da + ddt_direct
    dA = (dtp_c * da).sum(dim=(0, 2, 3))
    return ddtp, dA


def stage6_dt_preprocess(dt, ddtp, dt_bias=None, dt_softplus=False, dt_limit=(0.0, INF)):
    """Elementwise over (b, l, h) (fusable into stage 5), recomputing v = dt + dt_bias:
        clamp:     ddt' *= [lo <= w <= hi]  (torch.clamp's convention: the boundary passes the
                   gradient; the default (0, inf) too, like the forward)
        softplus:  *= 1 if v > 20 else sigmoid(v)   (torch's threshold; v = 20 gives sigmoid)
        ddt = that;  ddt_bias = sum_{b, l} ddt
    """
    v = dt if dt_bias is None else dt + dt_bias
    w = F.softplus(v) if dt_softplus else v
    g = torch.where((w >= dt_limit[0]) & (w <= dt_limit[1]), ddtp, torch.zeros_like(ddtp))
    if dt_softplus:
        g = g * torch.where(v > SOFTPLUS_THRESHOLD, torch.ones_like(v), torch.sigmoid(v))
    ddt_bias = None if dt_bias is None else g.sum(dim=(0, 1))
    return g, ddt_bias


# ----------------------------------------------------------------------------------------------
# the whole backward
# ----------------------------------------------------------------------------------------------

@autocast_off
def ssd_chunked_backward(x, dt, A, B, C, chunk_size, dout, dfinal_states=None, D=None, z=None,
                         dt_bias=None, initial_states=None, seq_idx=None, dt_softplus=False,
                         dt_limit=(0.0, INF), dtype=torch.float32):
    """Gradients of (out, final_states) of `reference.ssd_chunked` (same arguments) for the
    cotangents dout (b, l, h, p) (None: 0) and dfinal_states (b, h, p, n) (None: 0), computed
    in `dtype` with the explicit stage formulas above. Returns a dict with keys x, dt, A, B, C,
    D, z, dt_bias, initial_states: each gradient in its input's dtype, None for absent inputs.
    """
    inputs = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias,
                  initial_states=initial_states)
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    x, dt, A, B, C, D, z, dt_bias, h0, dout, dfin = map(
        cast, (x, dt, A, B, C, D, z, dt_bias, initial_states, dout, dfinal_states))
    b, l, nh = x.shape[:3]
    g = B.shape[2]
    Q = chunk_size
    if dout is None:
        dout = torch.zeros_like(x)

    grads = {}
    if l == 0:
        zeros = {k: None if t is None else torch.zeros_like(t, dtype=dtype)
                 for k, t in dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias).items()}
        grads.update(zeros)
        grads["initial_states"] = None if h0 is None else (
            torch.zeros_like(h0) if dfin is None else dfin)
        return _to_input_dtypes(grads, inputs)

    if seq_idx is not None and _readable(dt, seq_idx) and not _all_finite(dt):
        # The products below keep a NaN / Inf in its own packed sequence (selects), but a
        # non-finite dt step counts as -MAX_LOG_STEP in the chunk's cumsum, which does not
        # restart at a sequence change: the next sequence's decays would be differences of
        # large sums (1e-3 of its gradients in float32 at chunk 256). Where values can be
        # read, take each sequence apart instead (exact: the chunked form holds for chunks
        # that start anywhere; only the rounding moves)
        return _to_input_dtypes(_by_sequence(x, dt, A, B, C, Q, dout, dfin, D, z, dt_bias, h0,
                                             seq_idx, dt_softplus, dt_limit, dtype), inputs)
    nc = math.ceil(l / Q)
    masks = sequence_masks(seq_idx, b, l, Q, nc, x.device)
    x_c = to_chunks(x, Q, nc)                                               # (b, h, nc, Q, P)
    B_c = to_chunks(expand_groups(B, nh), Q, nc)                            # (b, h, nc, Q, N)
    C_c = to_chunks(expand_groups(C, nh), Q, nc)

    # stage 1
    dtp_c, G = stage1_dt_and_decay(dt, A, Q, nc, dt_bias, dt_softplus, dt_limit)
    entry, _final = stage1_entry_states(x_c, B_c, dtp_c, G, masks, h0)
    L = intra_decay(G, masks["same"])
    y_ssm = None
    if z is not None:
        y_ssm = from_chunks(stage1_pregate_output(x_c, B_c, C_c, dtp_c, G, L, masks, entry), l)

    # stage 2
    dy, dz, dD, dx_skip = stage2_gate_skip(dout, x, y_ssm, D, z)
    dy_c = to_chunks(dy, Q, nc)

    # stage 3
    dS, dinit = stage3_reverse_state_pass(dy_c, C_c, G, masks, dfin)

    # stage 4
    dx_c, ddt_direct = stage4_dx(x_c, dy_c, B_c, C_c, dtp_c, G, L, masks, dS)
    dC_c = stage4_dC(x_c, dy_c, B_c, dtp_c, G, L, masks, entry)
    dB_c = stage4_dB(x_c, dy_c, C_c, dtp_c, G, L, masks, dS)
    da = stage4_ddecay(x_c, dy_c, B_c, C_c, dtp_c, G, L, masks, entry, dS,
                       zero_start=h0 is None)

    # stages 5, 6 (da selected to 0 on the last chunk's padding, where 0 * NaN may have
    # reached it: dA sums dt' da over every position)
    real = (torch.arange(nc * Q, device=da.device) < l).reshape(nc, Q)
    da = torch.where(real, da, torch.zeros_like(da))
    ddtp_c, dA = stage5_decay_to_dt_A(da, ddt_direct, dtp_c, A)
    ddt, ddt_bias = stage6_dt_preprocess(dt, from_chunks(ddtp_c, l), dt_bias, dt_softplus,
                                         dt_limit)

    dx = from_chunks(dx_c, l)
    if dx_skip is not None:
        dx = dx + dx_skip
    grads.update(x=dx, dt=ddt, A=dA, B=sum_groups(from_chunks(dB_c, l), g),
                 C=sum_groups(from_chunks(dC_c, l), g), D=dD, z=dz, dt_bias=ddt_bias,
                 initial_states=None if h0 is None else dinit)
    return _to_input_dtypes(grads, inputs)


def _by_sequence(x, dt, A, B, C, Q, dout, dfin, D, z, dt_bias, h0, seq_idx, dt_softplus,
                 dt_limit, dtype):
    """`ssd_chunked_backward`'s gradients with each packed sequence of each row computed on its
    own: the row's initial state enters its first sequence and dfinal its last one (as the
    forward's reset defines them); A, D and dt_bias gather every sequence's share."""
    b, l = x.shape[:2]
    grads = dict(x=torch.zeros_like(x), dt=torch.zeros_like(dt), B=torch.zeros_like(B),
                 C=torch.zeros_like(C), z=None if z is None else torch.zeros_like(z),
                 A=torch.zeros_like(A), D=None if D is None else torch.zeros_like(D),
                 dt_bias=None if dt_bias is None else torch.zeros_like(dt_bias),
                 initial_states=None if h0 is None else torch.zeros_like(h0))
    seq = seq_idx.to(torch.int64).cpu()
    for r in range(b):
        cuts = [0] + (torch.nonzero(seq[r, 1:] != seq[r, :-1]).flatten() + 1).tolist() + [l]
        for k in range(len(cuts) - 1):
            lo, hi = cuts[k], cuts[k + 1]
            part = lambda t: None if t is None else t[r:r + 1, lo:hi]  # noqa: E731
            first, last = k == 0, k == len(cuts) - 2
            g = ssd_chunked_backward(
                part(x), part(dt), A, part(B), part(C), Q, part(dout),
                dfin[r:r + 1] if last and dfin is not None else None, D=D, z=part(z),
                dt_bias=dt_bias, initial_states=h0[r:r + 1] if first and h0 is not None
                else None, dt_softplus=dt_softplus, dt_limit=dt_limit, dtype=dtype)
            for name in ("x", "dt", "B", "C", "z"):
                if grads[name] is not None:
                    grads[name][r:r + 1, lo:hi] = g[name]
            for name in ("A", "D", "dt_bias"):
                if grads[name] is not None:
                    grads[name] = grads[name] + g[name]
            if first and h0 is not None:
                grads["initial_states"][r:r + 1] = g["initial_states"]
    return grads


def _to_input_dtypes(grads, inputs):
    return {k: None if inputs[k] is None else grads[k].to(inputs[k].dtype) for k in inputs}
