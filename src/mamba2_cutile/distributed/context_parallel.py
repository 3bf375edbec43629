"""Context parallelism for the SSD scan: one sequence split across ranks, only states on the wire.

Each rank holds one contiguous slice of the sequence (rank order = token order, any lengths,
empty slices included). With dt' the processed dt (dt_bias, softplus, dt_limit) and, inside a
slice, G_t = sum_{s <= t} A dt'_s, the SSD is linear in the state a slice starts from, h0:

    y_t   = y_t(zero start)   + exp(G_t) C_t . h0          (t before the slice's first
                                                             seq_idx boundary; z gates it too)
    h_end = h_end(zero start) + exp(G_last) h0              (no boundary in the slice)

and a boundary inside the slice (or between the slice's first token and the token before it on
an earlier rank) stops h0: its term is zero from that token on. So:

1. every rank scans its slice from a zero state with `mamba_chunk_scan_combined` (the first
   rank with `initial_states`): y(zero start) and S_r = h_end(zero start);
2. the ranks all-gather (S_r, G_last,r) in float32 (float64 for float64 inputs) and, when
   seq_idx is given, (first id, last id) per row;
3. rank r folds the earlier ranks in rank order, H <- m_q H + S_q for q < r with
   m_q = exp(G_last,q) if the state crosses slice q (no boundary in it or at its start) else 0,
   and so knows its true entry state H_r;
4. it adds the carried-state term exp(G_t) C_t . H_r (times silu(z_t)) to its outputs and
   returns its true end state S_r + m_r H_r.

The correction is an explicit C.h term, not a second pass of the scan: it costs one
(tokens x dstate) x (dstate x nheads*headdim) product, and only over the slice's *live prefix*,
the tokens before the first boundary where exp(G_t) is still a normal number of the compute
dtype for some head (with Mamba-2's A <= -1 and dt' >= 1e-3 the state has decayed below
float32's smallest normal after a few thousand tokens, so at 512K tokens per rank the
correction touches a few chunks). Finding that prefix reads one integer from the GPU (a host
synchronization); under CUDA-graph capture the prefix is the whole slice instead.

Backward: plain autograd through the local scan (the scan's custom op and its registered
backward: the cuTile kernels on CUDA tensors), the fold and the correction; the one collective
with a gradient is `_AllGather`, whose backward is its adjoint: each rank receives the sum over
ranks of the gradients with respect to its (S_r, G_last,r) (a reduce-scatter on NCCL, an
all-reduce of the gathered gradient elsewhere). So the gradient of the carried state flows back
from rank r to the end states of ranks < r through the decay chain, and each rank's gradients
of the replicated A, D and dt_bias are its partial sums (sum them over ranks, as DDP/FSDP do).
Every rank must backpropagate through at least one of its outputs: both depend on the gathered
tensor (through an exact zero where nothing else connects them), so that each rank's backward
joins the collective.

Bytes each rank sends (ring algorithms): forward (W - 1) x 4 x b x h x (p n + 1), plus
(W - 1) x 24 x b with seq_idx; backward the same again for the states (`bytes_sent_per_rank`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..checks import value_checks_enabled
from ..reference.common import process_dt
from ..ssd.api import _validate, mamba_chunk_scan_combined


# ----------------------------------------------------------------------------------------------
# the exchange
# ----------------------------------------------------------------------------------------------

class _AllGather(torch.autograd.Function):
    """(numel,) per rank -> (world, numel) on every rank; backward: the adjoint, each rank gets
    the sum over ranks of the gradient of its own row. `requires` (a scalar leaf that requires
    grad, or None) makes the output require grad on every rank under grad mode, also on a rank
    whose own inputs do not (an empty slice): the backward is a collective, every rank must
    run it."""

    @staticmethod
    def forward(ctx, piece, requires, group):
        ctx.group = group
        world = dist.get_world_size(group)
        out = piece.new_empty((world,) + tuple(piece.shape))
        if dist.get_backend(group) == "nccl":
            dist.all_gather_into_tensor(out, piece.contiguous(), group=group)
        else:
            dist.all_gather(list(out.unbind(0)), piece.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        group = ctx.group
        grad = grad.contiguous()
        if dist.get_backend(group) == "nccl":
            mine = grad.new_empty(grad.shape[1:])
            dist.reduce_scatter_tensor(mine, grad, group=group)
        else:   # gloo has no reduce-scatter: all-reduce the whole (small) gradient
            dist.all_reduce(grad, group=group)
            mine = grad[dist.get_rank(group)].clone()
        return mine, None, None


class _Anchor(torch.autograd.Function):
    """A scalar 0 whose backward gives the gathered tensor a zero gradient. Added to a rank's
    end state (and, through `_AddPrefix`, to its out), it puts the gather's backward (a collective the other ranks wait in) in the graph
    of every rank, also of one whose outputs do not otherwise depend on the gathered states
    (the first rank, a slice the carried state never reaches)."""

    @staticmethod
    def forward(ctx, anchor):
        ctx.shape, ctx.dtype = anchor.shape, anchor.dtype
        return anchor.new_zeros(())

    @staticmethod
    def backward(ctx, grad):
        return grad.new_zeros(ctx.shape, dtype=ctx.dtype)


def _all_gather_ints(t, group):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return torch.stack(out)


class _Exchange:
    """The collectives of one call: torch.distributed on `group`, or none for a single rank."""

    def __init__(self, group):
        if group is None and not dist.is_initialized():
            if int(os.environ.get("WORLD_SIZE", "1")) > 1:
                raise ValueError("WORLD_SIZE > 1 but torch.distributed is not initialized: call "
                                 "torch.distributed.init_process_group first (or pass group)")
            self.group, self.rank, self.world = None, 0, 1
            return
        if group is None:
            group = dist.group.WORLD
        self.group, self.rank, self.world = group, dist.get_rank(group), \
            dist.get_world_size(group)
        if self.rank < 0:
            raise ValueError("group: this process is not a member of the given process group")

    def gather_states(self, piece):
        if self.world == 1:
            return piece[None]
        requires = piece.new_zeros((), requires_grad=True) if torch.is_grad_enabled() else None
        return _AllGather.apply(piece, requires, self.group)

    def gather_ints(self, t):
        if self.world == 1:
            return t[None]
        return _all_gather_ints(t, self.group)

    def failed_ranks(self, failed: bool):
        """The ranks whose arguments failed their local checks (one one-integer all-gather and
        a host read), so that an error on one rank raises on every rank instead of leaving the
        others waiting in the next collective."""
        if self.world == 1:
            return [0] if failed else []
        nccl = dist.get_backend(self.group) == "nccl"
        dev = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        flags = _all_gather_ints(torch.tensor([int(failed)], device=dev), self.group)
        return [r for r, f in enumerate(flags.flatten().tolist()) if f]


def bytes_sent_per_rank(batch, nheads, headdim, dstate, world, seq_idx=False,
                        state_bytes=4):
    """Bytes one rank sends with ring collectives: {"forward": ..., "backward": ...}.

    Forward: the all-gather of (end state, total decay) per (row, head), state_bytes each, and
    with seq_idx the (non-empty, first id, last id) triples as int64; backward: the reduce-scatter of the
    states' gradients, the same size as the forward's states. NCCL's ring all-gather and
    reduce-scatter each send (world - 1) pieces per rank.
    """
    piece = state_bytes * batch * nheads * (headdim * dstate + 1)
    ints = 24 * batch if seq_idx else 0
    return {"forward": (world - 1) * (piece + ints), "backward": (world - 1) * piece}


# ----------------------------------------------------------------------------------------------
# the two stages of a rank
# ----------------------------------------------------------------------------------------------

@dataclass
class LocalScan:
    """What a rank computes from its slice alone (stage 1)."""
    out: torch.Tensor            # (b, l, h, p): y from a zero start (rank 0: initial_states)
    end_state: torch.Tensor      # (b, h, p, n), compute dtype: S_r
    decay_log: torch.Tensor      # (b, l, h), compute dtype: G_t, the slice's cumsum of A dt'
    total_log: torch.Tensor      # (b, h): G at the slice's last token (0 for an empty slice)
    seq_info: Optional[torch.Tensor]   # (b, 3) int64: nonempty, first id, last id
    same_as_first: Optional[torch.Tensor]   # (b, l) bool: token still in the first sequence

    def piece(self):
        """The flat tensor this rank sends: S_r then G_last,r."""
        return torch.cat([self.end_state.reshape(-1), self.total_log.reshape(-1)])


def _compute_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def local_scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
               seq_idx=None, dt_softplus=False, dt_limit=(0.0, float("inf"))) -> LocalScan:
    """Stage 1: the slice scanned from a zero state (or initial_states) with the library's scan,
    its zero-start end state and its decay cumsum (from the processed dt, in the compute
    dtype)."""
    b, l, h, p = x.shape
    n = B.shape[3]
    cdt = _compute_dtype(x)
    if l == 0:
        # an empty slice passes the state through: S = initial_states (or 0), decay 1; the
        # replicated parameters still get a (zero) gradient on this rank, which DDP and FSDP
        # wait for
        out = x.new_zeros(x.shape) + 0 * sum(t.sum() for t in (A, D, dt_bias) if t is not None)
        end = initial_states.to(cdt) if initial_states is not None else \
            x.new_zeros((b, h, p, n), dtype=cdt)
        G = x.new_zeros((b, 0, h), dtype=cdt)
        total = x.new_zeros((b, h), dtype=cdt)
    else:
        out, end = mamba_chunk_scan_combined(
            x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias,
            initial_states=initial_states, seq_idx=seq_idx, dt_softplus=dt_softplus,
            dt_limit=dt_limit, return_final_states=True)
        end = end.to(cdt)
        dtp = process_dt(dt.to(cdt), None if dt_bias is None else dt_bias.to(cdt),
                         dt_softplus, dt_limit)
        # A dt' = 0 where dt' = 0, also for A = -inf (a decay of exactly 1, not -inf * 0)
        step = A.to(cdt)[None, None, :] * dtp
        G = torch.cumsum(torch.where(dtp == 0, torch.zeros_like(step), step), dim=1)
        total = G[:, -1]
    seq_info = same = None
    if seq_idx is not None:
        seq = seq_idx.to(torch.int64)
        if l == 0:
            seq_info = torch.zeros(b, 3, dtype=torch.int64, device=x.device)
        else:
            seq_info = torch.stack([torch.ones_like(seq[:, 0]), seq[:, 0], seq[:, -1]], dim=1)
            same = seq == seq[:, :1]
    return LocalScan(out, end, G, total, seq_info, same)


def crossing(seq_infos, world):
    """From the gathered (world, b, 3) seq infos: per rank, whether the state arriving at its
    first token enters it (`enters`, (world, b) bool: its first id equals the last id of the
    nearest earlier non-empty slice, or there is none) and whether it crosses the whole slice
    (`crosses`: enters and the slice holds one sequence id). Empty slices pass it through.
    Also returns whether the ids are non-decreasing across slice edges (`ordered`, (b,))."""
    b = seq_infos.shape[1]
    seen = torch.zeros(b, dtype=torch.bool, device=seq_infos.device)
    last = torch.zeros(b, dtype=torch.int64, device=seq_infos.device)
    ordered = torch.ones(b, dtype=torch.bool, device=seq_infos.device)
    enters, crosses = [], []
    for q in range(world):
        nonempty, first, last_q = seq_infos[q].unbind(1)
        nonempty = nonempty.bool()
        enter = torch.where(nonempty, ~seen | (first == last), True)
        enters.append(enter)
        crosses.append(torch.where(nonempty, enter & (first == last_q), True))
        ordered &= ~(nonempty & seen) | (first >= last)
        last = torch.where(nonempty, last_q, last)
        seen |= nonempty
    return torch.stack(enters), torch.stack(crosses), ordered


def finish(local: LocalScan, gathered, seq_infos, rank, world, C, z=None, anchor=None,
           full_prefix=False):
    """Stage 2 of rank `rank`: fold the earlier ranks' (S_q, G_last,q) (`gathered`, (world,
    b*h*p*n + b*h)) into the entry state H_r, correct the outputs by exp(G_t) C_t . H_r over
    the live prefix, and return (out, true end state). `seq_infos`: the gathered (world, b, 3)
    or None without seq_idx. `full_prefix`: correct every token (no host read of the live
    prefix's length)."""
    out, S = local.out, local.end_state
    b, l, h, p = out.shape
    n = S.shape[-1]
    cdt = S.dtype
    nstate = b * h * p * n
    states = gathered[:, :nstate].reshape(world, b, h, p, n)
    totals = gathered[:, nstate:].reshape(world, b, h)
    if seq_infos is None:
        enters = crosses = None
    else:
        enters, crosses, _ = crossing(seq_infos, world)

    def carried(q, H):      # m_q H of the docstring, (b, h, p, n)
        mh = torch.exp(totals[q])[:, :, None, None] * H
        if crosses is not None:
            # selected, not multiplied by 0: H may be another sequence's NaN
            mh = torch.where(crosses[q][:, None, None, None], mh, torch.zeros_like(mh))
        return mh

    H = None
    for q in range(rank):
        H = states[q] if H is None else carried(q, H) + states[q]
    term = None
    if H is None:      # the first rank: nothing arrives
        final = S
    else:
        final = S + carried(rank, H)
        if l > 0:
            term = carried_term(local, H, C, z, enters, rank, full_prefix)
    if anchor is not None:
        final = final + _Anchor.apply(anchor)
    if term is not None or anchor is not None:
        if term is None:
            term = out.new_zeros((b, 0, h, p), dtype=cdt)
        out = _AddPrefix.apply(out, term, anchor)
    return out, final


def carried_term(local, H, C, z, enters, rank, full_prefix):
    """silu?(z_t) exp(G_t) C_t . H over the live prefix [0, K) of the slice: (b, K, h, p) in
    the compute dtype (K = 0: nothing left to correct)."""
    G = local.decay_log
    cdt = G.dtype
    b, l, h = G.shape
    g, n = C.shape[2], C.shape[3]
    p = H.shape[2]
    live = torch.ones_like(G, dtype=torch.bool)
    if local.same_as_first is not None:
        live = live & local.same_as_first[:, :, None] & enters[rank][:, None, None]
    if full_prefix:
        K = l
    else:
        # below the compute dtype's smallest normal the term is flushed on the GPU anyway;
        # where exp(G_t) is that small for every head the term is at most 1e-38 |C| |H|
        live_any = (live & (G >= math.log(torch.finfo(cdt).tiny))).any(dim=2).any(dim=0)
        idx = torch.arange(1, l + 1, device=G.device)
        K = int((live_any * idx).max())
    w = torch.exp(G[:, :K])                                                 # (b, K, h)
    Ck = C[:, :K].to(cdt)                                                   # (b, K, g, n)
    Hg = H.reshape(b, g, h // g, p, n)
    term = torch.einsum("bkgn,bgjpn->bkgjp", Ck, Hg).reshape(b, K, h, p) * w[..., None]
    # selected, not multiplied by 0: the arriving state may be another sequence's NaN
    term = torch.where(live[:, :K, :, None], term, torch.zeros_like(term))
    if z is not None:
        term = term * F.silu(z[:, :K].to(cdt))
    return term


class _AddPrefix(torch.autograd.Function):
    """out[:, :K] += term in place (term: (b, K, h, p)), with a backward that passes out's
    gradient through as it is (autograd's own in-place-on-a-slice would copy the whole
    gradient of out). `anchor` (the gathered states, or None) gets a zero gradient: it puts the
    gather's backward, a collective, in the graph of every rank's out."""

    @staticmethod
    def forward(ctx, out, term, anchor):
        K = term.shape[1]
        if K:
            out[:, :K] += term.to(out.dtype)
        ctx.mark_dirty(out)
        ctx.K, ctx.term_dtype = K, term.dtype
        ctx.anchor_meta = None if anchor is None else (anchor.shape, anchor.dtype)
        return out

    @staticmethod
    def backward(ctx, grad):
        d_term = grad[:, :ctx.K].to(ctx.term_dtype) if ctx.needs_input_grad[1] else None
        d_anchor = None
        if ctx.anchor_meta is not None and ctx.needs_input_grad[2]:
            d_anchor = grad.new_zeros(ctx.anchor_meta[0], dtype=ctx.anchor_meta[1])
        return grad, d_term, d_anchor


# ----------------------------------------------------------------------------------------------
# the public function
# ----------------------------------------------------------------------------------------------

def _check_across_ranks(ex, x, B, chunk_size, D, z, dt_bias, seq_idx, dt_softplus, dt_limit):
    """That every rank passed the same problem (shapes other than the slice length, options),
    so that the collectives agree; the same ValueError on every rank. Reads values (a host
    synchronization), so it runs where the scan's value checks do."""
    b, _, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    lo, hi = (float(v) for v in dt_limit)
    dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    meta = torch.tensor([b, h, p, g, n, chunk_size, seq_idx is not None, z is not None,
                         -1 if D is None else D.dim(), dt_bias is not None, bool(dt_softplus),
                         lo, hi, dtypes.index(x.dtype)],
                        dtype=torch.float64, device=x.device)
    allm = ex.gather_ints(meta)
    if not bool((allm == allm[:1]).all()):
        raise ValueError("chunk_scan_cp: the ranks' arguments disagree (batch, nheads, headdim, "
                         "ngroups, dstate, chunk_size, which options are given, dt_softplus, "
                         "dt_limit or x's dtype); only the sequence length may differ: "
                         f"{allm.tolist()}")


@torch.compiler.disable     # eager collectives and a host read: torch.compile runs it eagerly
def chunk_scan_cp(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                  initial_states=None, seq_idx=None, dt_softplus=False,
                  dt_limit=(0.0, float("inf")), return_final_states=False, group=None,
                  cu_seqlens=None, return_varlen_states=False):
    """`mamba_chunk_scan_combined` over one sequence split across the ranks of `group` (the
    default process group unless given; a single process without torch.distributed is one
    rank).

    Each rank passes its own contiguous slice of every per-token tensor (x, dt, B, C, z,
    seq_idx: (b, l_r, ...), in rank order, any l_r >= 0) and the same A, D, dt_bias.
    `seq_idx` holds global ids, continuing across slice edges: a boundary inside a slice or
    exactly at its first token stops the carried state. `initial_states` is given on rank 0
    only. Returns out (x's dtype) for the rank's slice, and with return_final_states the true
    state at the end of the slice (float32; on the last rank the sequence's final state).

    Gradients: those of the rank's slice; for A, D, dt_bias this rank's partial sums. Every
    rank must call this function (and backpropagate through its outputs) the same number of
    times in the same order. Next to DDP/FSDP, give the context-parallel ranks their own
    group (`torch.distributed.new_group`): the backward's collective runs when the autograd
    engine reaches it, and its order relative to the data-parallel all-reduces on one shared
    group could differ between ranks. cu_seqlens / varlen states are not supported.

    Checks: the arguments of each rank as `mamba_chunk_scan_combined` checks them; where that
    function reads values (CPU tensors, or MAMBA2_CUTILE_CHECK=1) also that all ranks pass
    the same problem and that seq_idx does not decrease across slice edges (one small
    all-gather and a host synchronization), raising the same ValueError on every rank.
    """
    if cu_seqlens is not None or return_varlen_states:
        raise ValueError("chunk_scan_cp does not support cu_seqlens / return_varlen_states: "
                         "use seq_idx (global ids) for several sequences in one row")
    if group is not None and not dist.is_initialized():
        raise ValueError("group is given but torch.distributed is not initialized")
    ex = _Exchange(group)
    error = None
    try:
        if initial_states is not None and ex.rank != 0:
            raise ValueError(f"initial_states must be given on the first rank only (rank 0 of "
                             f"the group); this is rank {ex.rank}")
        _validate(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, None,
                  dt_limit, False, None)
    except (ValueError, TypeError) as e:
        error = e
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    if not capturing:           # a host read: not under CUDA-graph capture
        failed = ex.failed_ranks(error is not None)
        if error is None and failed:
            raise ValueError(f"chunk_scan_cp: the arguments of rank(s) {failed} were refused "
                             f"(the error is raised there)")
    if error is not None:
        raise error
    checking = ex.world > 1 and value_checks_enabled(x.is_cuda)
    if checking:
        _check_across_ranks(ex, x, B, chunk_size, D, z, dt_bias, seq_idx, dt_softplus,
                            dt_limit)

    local = local_scan(x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias,
                       initial_states=initial_states, seq_idx=seq_idx,
                       dt_softplus=dt_softplus, dt_limit=dt_limit)
    gathered = ex.gather_states(local.piece())
    seq_infos = None if local.seq_info is None else ex.gather_ints(local.seq_info)
    if checking and seq_infos is not None:
        if not bool(crossing(seq_infos, ex.world)[2].all()):
            raise ValueError("seq_idx must be non-decreasing along each row across the ranks' "
                             "slices (the first id of a slice below the last of an earlier one)")
    capturing = capturing and x.is_cuda
    out, final = finish(local, gathered, seq_infos, ex.rank, ex.world, C, z=z,
                        anchor=gathered if ex.world > 1 else None, full_prefix=capturing)
    if return_final_states:
        return out, final.to(torch.float32)
    return out


# ----------------------------------------------------------------------------------------------
# ranks simulated in one process
# ----------------------------------------------------------------------------------------------

def simulate_ranks(lengths, x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                   initial_states=None, seq_idx=None, dt_softplus=False,
                   dt_limit=(0.0, float("inf")), full_prefix=False):
    """The whole sequence cut into slices of `lengths` (summing to x.shape[1]), each slice
    through the same two stages as `chunk_scan_cp`, the all-gather done by hand (a stack, whose
    autograd adjoint is the reduce-scatter). Returns (out of the whole sequence, [true end state
    of each slice]); differentiable like the real thing (the replicated tensors' gradients are
    then the sums over ranks). `full_prefix`: the correction over whole slices, as under
    CUDA-graph capture."""
    if sum(lengths) != x.shape[1] or any(k < 0 for k in lengths):
        raise ValueError(f"lengths must be >= 0 and sum to seqlen ({x.shape[1]}), got {lengths}")
    world = len(lengths)
    cuts = [0]
    for k in lengths:
        cuts.append(cuts[-1] + k)
    part = lambda t, r: None if t is None else t[:, cuts[r]:cuts[r + 1]]  # noqa: E731
    locals_ = [local_scan(part(x, r), part(dt, r), A, part(B, r), part(C, r), chunk_size, D=D,
                          z=part(z, r), dt_bias=dt_bias,
                          initial_states=initial_states if r == 0 else None,
                          seq_idx=part(seq_idx, r), dt_softplus=dt_softplus, dt_limit=dt_limit)
               for r in range(world)]
    gathered = torch.stack([loc.piece() for loc in locals_])
    seq_infos = None if seq_idx is None else torch.stack([loc.seq_info for loc in locals_])
    outs, finals = [], []
    for r in range(world):
        o, f = finish(locals_[r], gathered, seq_infos, r, world, part(C, r), z=part(z, r),
                      full_prefix=full_prefix)
        outs.append(o)
        finals.append(f.to(torch.float32))
    return torch.cat(outs, dim=1), finals
