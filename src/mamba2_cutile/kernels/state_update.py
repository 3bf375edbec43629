"""The decode step: the selective state update of K new tokens per batch row, in place.

For batch row r, its state slot s (row r, or state_batch_indices[r]), head i (group
g = i // HEADS_PER_GROUP), channel p, state entry n, and each new token t = 0..K-1 in order:

    dt'    = dt[r,t,i,p] + dt_bias[i,p]          (softplus(dt') if SOFTPLUS)
    h[p,n] = exp(A[i,p,n] * dt') * h[p,n] + dt' * x[r,t,i,p] * B[r,t,g,n]
    y[r,t,i,p] = sum_n h[p,n] * C[r,t,g,n] + D[i,p] * x[r,t,i,p]   (* z * sigmoid(z) if HAS_Z)

h = state[s, i] is loaded once, kept on chip in float32 across the K steps (optionally copied
to out_states[r, t, i] after each step), and stored back in the state's dtype at the end.
A negative slot, or one past the state (unvalidated on the GPU), marks a padding row: y is 0,
nothing else is read or written.

Per-head layouts (the usual Mamba-2 case): DT_HEAD reads dt as (B, K, H), A_HEAD reads A as
(H,) (one exp per channel instead of one per state entry), D_MODE / BIAS_MODE 1 read D /
dt_bias as (H,); 2 reads them as (H, P); 0 means absent.

Tiles: the state (BLOCK_P, NP), NP = dstate rounded up to a power of two (zero padding).
Grid: (batch, nheads, cdiv(P, BLOCK_P)), or with PERSISTENT a (programs,) grid looping over
those tiles in memory order (one program per tile for the dispatcher's `flat` option).
Memory-bound: the state is read and written once. With BLOCK_N (one token per call only) a
program walks dstate in (BLOCK_P, BLOCK_N) slices instead of holding it whole.
"""

import cuda.tile as ct

from ._common import int64_variant


def _step_dt(dt, dt_bias, row, t, head, p_tile, BLOCK_P: ct.Constant[int],
             DT_HEAD: ct.Constant[bool], BIAS_MODE: ct.Constant[int],
             SOFTPLUS: ct.Constant[bool]):
    """dt' of step t for the BLOCK_P channels, as a (BLOCK_P, 1) float32 column."""
    ZERO = ct.PaddingMode.ZERO
    if DT_HEAD:
        d = ct.load(dt, index=(row, t, head), shape=(1, 1, 1)).reshape((1, 1))
        d = ct.broadcast_to(d.astype(ct.float32), (BLOCK_P, 1))
    else:
        d = ct.load(dt, index=(row, t, head, p_tile), shape=(1, 1, 1, BLOCK_P),
                    padding_mode=ZERO).reshape((BLOCK_P, 1)).astype(ct.float32)
    if BIAS_MODE == 1:
        d = d + ct.load(dt_bias, index=(head,), shape=(1,)).reshape((1, 1)).astype(ct.float32)
    if BIAS_MODE == 2:
        d = d + ct.load(dt_bias, index=(head, p_tile), shape=(1, BLOCK_P),
                        padding_mode=ZERO).reshape((BLOCK_P, 1)).astype(ct.float32)
    if SOFTPLUS:
        # softplus(v) = log1p(e^v), and v itself above 20 (torch's threshold);
        # log1p(u) = log(w) * u / (w - 1), w = 1 + u: exact to rounding for tiny u
        u = ct.exp(ct.minimum(d, 20.0))
        w = 1.0 + u
        log1p_u = ct.where(w == 1.0, u, ct.log(w) * (u / (w - 1.0)))
        d = ct.where(d > 20.0, d, log1p_u)
    return d


def _finish_y(yv, xv, D, z, y, row, t, head, p_tile, BLOCK_P: ct.Constant[int],
              D_MODE: ct.Constant[int], HAS_Z: ct.Constant[bool]):
    """y = (C.h + D x) * silu(z) for step t, stored."""
    if D_MODE == 1:
        yv = yv + ct.load(D, index=(head,), shape=(1,)).reshape((1, 1)).astype(ct.float32) * xv
    if D_MODE == 2:
        yv = yv + ct.load(D, index=(head, p_tile), shape=(1, BLOCK_P),
                          padding_mode=ct.PaddingMode.ZERO).reshape(
                              (BLOCK_P, 1)).astype(ct.float32) * xv
    if HAS_Z:
        zv = ct.load(z, index=(row, t, head, p_tile), shape=(1, 1, 1, BLOCK_P),
                     padding_mode=ct.PaddingMode.ZERO).reshape((BLOCK_P, 1)).astype(ct.float32)
        yv = yv * (zv / (1.0 + ct.exp(-zv)))
    ct.store(y, index=(row, t, head, p_tile), tile=yv.reshape((1, 1, 1, BLOCK_P)).astype(y.dtype))


def _slot_of(slots, row, nslots, HAS_IDX: ct.Constant[bool]):
    """Row's state slot; negative (a padding row) for a negative slot, and -1 for one past the
    state, so that no state access can leave the state even without bounds checks."""
    slot = ct.full((1,), 0, dtype=ct.int32).item() + row
    if HAS_IDX:
        slot = ct.load(slots, index=(row,), shape=(1,)).item()
        if slot >= nslots:
            slot = -1
    return slot


def _load_state(state, slot, head, p_tile, nt, BLOCK_P: ct.Constant[int], W: ct.Constant[int],
                LATENCY: ct.Constant[int], LOAD_TMA: ct.Constant[bool],
                IN_BOUNDS: ct.Constant[bool]):
    """(BLOCK_P, W) float32 slice of the state. LATENCY: load latency hint (1-10, 0: none);
    LOAD_TMA False: plain vector loads straight into registers (no SMEM round trip);
    IN_BOUNDS: the dispatcher knows every state tile lies inside the state (P a multiple of
    BLOCK_P, N of W, the slot checked), so no bounds checks. Checked plain loads are each
    guarded by a branch that consumes the loaded registers before the next load is issued, so
    a thread has one load in flight at a time; unchecked, all of them go out back to back."""
    idx = (slot, head, p_tile, nt)
    shape = (1, 1, BLOCK_P, W)
    if IN_BOUNDS:
        # in bounds: no padding to define (tileiras rejects a padding mode without checks)
        if LATENCY == 0:
            t = ct.load(state, index=idx, shape=shape, allow_tma=LOAD_TMA, check_bounds=False)
        else:
            t = ct.load(state, index=idx, shape=shape, allow_tma=LOAD_TMA, check_bounds=False,
                        latency=LATENCY)
    elif LATENCY == 0:
        t = ct.load(state, index=idx, shape=shape, padding_mode=ct.PaddingMode.ZERO,
                    allow_tma=LOAD_TMA)
    else:
        t = ct.load(state, index=idx, shape=shape, padding_mode=ct.PaddingMode.ZERO,
                    allow_tma=LOAD_TMA, latency=LATENCY)
    return t.reshape((BLOCK_P, W)).astype(ct.float32)


def _store_state(state, h, slot, head, p_tile, nt, BLOCK_P: ct.Constant[int],
                 W: ct.Constant[int], STORE_TMA: ct.Constant[bool], IN_BOUNDS: ct.Constant[bool]):
    tile = h.reshape((1, 1, BLOCK_P, W)).astype(state.dtype)
    if STORE_TMA:
        ct.store(state, index=(slot, head, p_tile, nt), tile=tile, check_bounds=not IN_BOUNDS)
    else:
        ct.store(state, index=(slot, head, p_tile, nt), tile=tile, allow_tma=False,
                 check_bounds=not IN_BOUNDS)


def _load_vec(arr, index, shape, VEC_TMA: ct.Constant[bool]):
    """A small per-step load (x, B, C), zero padded; VEC_TMA False: without TMA."""
    if not VEC_TMA:
        return ct.load(arr, index=index, shape=shape, padding_mode=ct.PaddingMode.ZERO,
                       allow_tma=False)
    return ct.load(arr, index=index, shape=shape, padding_mode=ct.PaddingMode.ZERO)


def _update_tile(
    state, x, dt, A, b, c, D, z, dt_bias, slots, out_states, y, row, head, p_tile,
    BLOCK_P: ct.Constant[int], NP: ct.Constant[int], HEADS_PER_GROUP: ct.Constant[int],
    DT_HEAD: ct.Constant[bool], A_HEAD: ct.Constant[bool], D_MODE: ct.Constant[int],
    BIAS_MODE: ct.Constant[int], HAS_Z: ct.Constant[bool], SOFTPLUS: ct.Constant[bool],
    HAS_IDX: ct.Constant[bool], HAS_OUT: ct.Constant[bool],
    LATENCY: ct.Constant[int], LOAD_TMA: ct.Constant[bool], STORE_TMA: ct.Constant[bool],
    VEC_TMA: ct.Constant[bool], IN_BOUNDS: ct.Constant[bool],
):
    """All K steps of one (row, head, p tile), the whole (BLOCK_P, NP) state on chip."""
    group = head // HEADS_PER_GROUP
    nsteps = x.shape[1]
    ZERO = ct.PaddingMode.ZERO
    slot = _slot_of(slots, row, state.shape[0], HAS_IDX)
    if slot >= 0:
        h = _load_state(state, slot, head, p_tile, 0, BLOCK_P, NP, LATENCY, LOAD_TMA,
                        IN_BOUNDS)
        if A_HEAD:
            a = ct.load(A, index=(head,), shape=(1,)).reshape((1, 1)).astype(ct.float32)
        else:
            a = ct.load(A, index=(head, p_tile, 0), shape=(1, BLOCK_P, NP),
                        padding_mode=ZERO).reshape((BLOCK_P, NP)).astype(ct.float32)
        for t in range(nsteps):
            d = _step_dt(dt, dt_bias, row, t, head, p_tile, BLOCK_P, DT_HEAD, BIAS_MODE,
                         SOFTPLUS)
            xv = _load_vec(x, (row, t, head, p_tile), (1, 1, 1, BLOCK_P),
                           VEC_TMA).reshape((BLOCK_P, 1)).astype(ct.float32)
            bv = _load_vec(b, (row, t, group, 0), (1, 1, 1, NP),
                           VEC_TMA).reshape((1, NP)).astype(ct.float32)
            cv = _load_vec(c, (row, t, group, 0), (1, 1, 1, NP),
                           VEC_TMA).reshape((1, NP)).astype(ct.float32)
            h = h * ct.exp(a * d) + (d * xv) * bv
            if HAS_OUT:
                ct.store(out_states, index=(row, t, head, p_tile, 0),
                         tile=h.reshape((1, 1, 1, BLOCK_P, NP)).astype(out_states.dtype))
            _finish_y(ct.sum(h * cv, axis=1, keepdims=True), xv, D, z, y, row, t, head,
                      p_tile, BLOCK_P, D_MODE, HAS_Z)
        _store_state(state, h, slot, head, p_tile, 0, BLOCK_P, NP, STORE_TMA, IN_BOUNDS)
    else:
        zeros = ct.full((1, 1, 1, BLOCK_P), 0.0, dtype=y.dtype)
        for t in range(nsteps):
            ct.store(y, index=(row, t, head, p_tile), tile=zeros)


def _update_tile_split_n(
    state, x, dt, A, b, c, D, z, dt_bias, slots, out_states, y, row, head, p_tile,
    BLOCK_P: ct.Constant[int], BLOCK_N: ct.Constant[int], HEADS_PER_GROUP: ct.Constant[int],
    DT_HEAD: ct.Constant[bool], A_HEAD: ct.Constant[bool], D_MODE: ct.Constant[int],
    BIAS_MODE: ct.Constant[int], HAS_Z: ct.Constant[bool], SOFTPLUS: ct.Constant[bool],
    HAS_IDX: ct.Constant[bool], HAS_OUT: ct.Constant[bool],
    LATENCY: ct.Constant[int], LOAD_TMA: ct.Constant[bool], STORE_TMA: ct.Constant[bool],
    VEC_TMA: ct.Constant[bool], IN_BOUNDS: ct.Constant[bool],
):
    """One step (K = 1) of one (row, head, p tile), the state walked in (BLOCK_P, BLOCK_N)
    slices: fewer live registers per thread (no spills at high occupancy), and a loop whose
    next slice can load while this one computes."""
    group = head // HEADS_PER_GROUP
    ZERO = ct.PaddingMode.ZERO
    slot = _slot_of(slots, row, state.shape[0], HAS_IDX)
    if slot >= 0:
        d = _step_dt(dt, dt_bias, row, 0, head, p_tile, BLOCK_P, DT_HEAD, BIAS_MODE, SOFTPLUS)
        xv = _load_vec(x, (row, 0, head, p_tile), (1, 1, 1, BLOCK_P),
                       VEC_TMA).reshape((BLOCK_P, 1)).astype(ct.float32)
        dx = d * xv
        decay = d
        if A_HEAD:
            decay = ct.exp(ct.load(A, index=(head,), shape=(1,)).reshape((1, 1)).astype(
                ct.float32) * d)
        yv = ct.full((BLOCK_P, 1), 0.0, dtype=ct.float32)
        # cdiv(N, BLOCK_N), not NP // BLOCK_N: a slice wholly past dstate would load out of
        # bounds
        for nt in range(ct.cdiv(state.shape[3], BLOCK_N)):
            h = _load_state(state, slot, head, p_tile, nt, BLOCK_P, BLOCK_N, LATENCY,
                            LOAD_TMA, IN_BOUNDS)
            bv = _load_vec(b, (row, 0, group, nt), (1, 1, 1, BLOCK_N),
                           VEC_TMA).reshape((1, BLOCK_N)).astype(ct.float32)
            cv = _load_vec(c, (row, 0, group, nt), (1, 1, 1, BLOCK_N),
                           VEC_TMA).reshape((1, BLOCK_N)).astype(ct.float32)
            if A_HEAD:
                h = h * decay + dx * bv
            else:
                a = ct.load(A, index=(head, p_tile, nt), shape=(1, BLOCK_P, BLOCK_N),
                            padding_mode=ZERO).reshape((BLOCK_P, BLOCK_N)).astype(ct.float32)
                h = h * ct.exp(a * d) + dx * bv
            if HAS_OUT:
                ct.store(out_states, index=(row, 0, head, p_tile, nt),
                         tile=h.reshape((1, 1, 1, BLOCK_P, BLOCK_N)).astype(out_states.dtype))
            yv = yv + ct.sum(h * cv, axis=1, keepdims=True)
            _store_state(state, h, slot, head, p_tile, nt, BLOCK_P, BLOCK_N, STORE_TMA,
                         IN_BOUNDS)
        _finish_y(yv, xv, D, z, y, row, 0, head, p_tile, BLOCK_P, D_MODE, HAS_Z)
    else:
        ct.store(y, index=(row, 0, head, p_tile), tile=ct.full((1, 1, 1, BLOCK_P), 0.0,
                                                              dtype=y.dtype))


def _tile(
    state, x, dt, A, b, c, D, z, dt_bias, slots, out_states, y, row, head, p_tile,
    BLOCK_P: ct.Constant[int], NP: ct.Constant[int], HEADS_PER_GROUP: ct.Constant[int],
    DT_HEAD: ct.Constant[bool], A_HEAD: ct.Constant[bool], D_MODE: ct.Constant[int],
    BIAS_MODE: ct.Constant[int], HAS_Z: ct.Constant[bool], SOFTPLUS: ct.Constant[bool],
    HAS_IDX: ct.Constant[bool], HAS_OUT: ct.Constant[bool], BLOCK_N: ct.Constant[int],
    LATENCY: ct.Constant[int], LOAD_TMA: ct.Constant[bool], STORE_TMA: ct.Constant[bool],
    VEC_TMA: ct.Constant[bool], IN_BOUNDS: ct.Constant[bool],
):
    if BLOCK_N == 0:
        _update_tile(state, x, dt, A, b, c, D, z, dt_bias, slots, out_states, y, row, head,
                     p_tile, BLOCK_P, NP, HEADS_PER_GROUP, DT_HEAD, A_HEAD, D_MODE,
                     BIAS_MODE, HAS_Z, SOFTPLUS, HAS_IDX, HAS_OUT, LATENCY, LOAD_TMA,
                     STORE_TMA, VEC_TMA, IN_BOUNDS)
    else:
        _update_tile_split_n(state, x, dt, A, b, c, D, z, dt_bias, slots, out_states, y, row,
                             head, p_tile, BLOCK_P, BLOCK_N, HEADS_PER_GROUP, DT_HEAD,
                             A_HEAD, D_MODE, BIAS_MODE, HAS_Z, SOFTPLUS, HAS_IDX, HAS_OUT,
                             LATENCY, LOAD_TMA, STORE_TMA, VEC_TMA, IN_BOUNDS)


def state_update_fn(
    state,       # (S, H, P, N) float32/bf16/fp16, updated in place
    x,           # (B, K, H, P)
    dt,          # (B, K, H) if DT_HEAD else (B, K, H, P)
    A,           # (H,) if A_HEAD else (H, P, N)
    b,           # (B, K, G, N)
    c,           # (B, K, G, N)
    D,           # (H,) / (H, P) per D_MODE (ignored if 0)
    z,           # (B, K, H, P) (ignored unless HAS_Z)
    dt_bias,     # (H,) / (H, P) per BIAS_MODE (ignored if 0)
    slots,       # (B,) int32 (ignored unless HAS_IDX)
    out_states,  # (B, K, H, P, N) (ignored unless HAS_OUT)
    y,           # (B, K, H, P) x's dtype
    BLOCK_P: ct.Constant[int],
    NP: ct.Constant[int],
    HEADS_PER_GROUP: ct.Constant[int],
    DT_HEAD: ct.Constant[bool],
    A_HEAD: ct.Constant[bool],
    D_MODE: ct.Constant[int],
    BIAS_MODE: ct.Constant[int],
    HAS_Z: ct.Constant[bool],
    SOFTPLUS: ct.Constant[bool],
    HAS_IDX: ct.Constant[bool],
    HAS_OUT: ct.Constant[bool],
    PERSISTENT: ct.Constant[bool],
    BLOCK_N: ct.Constant[int],    # 0: the whole state per program; else K = 1, N in slices
    LATENCY: ct.Constant[int],    # state load latency hint (1-10; 0: none)
    LOAD_TMA: ct.Constant[bool],  # state loads through TMA (else plain vector loads)
    STORE_TMA: ct.Constant[bool],  # state stores through TMA
    VEC_TMA: ct.Constant[bool],   # x, B, C loads through TMA
    IN_BOUNDS: ct.Constant[bool],  # every state tile lies inside the state: no bounds checks
):
    if PERSISTENT:
        # a fixed grid walks the (row, head, p tile) tiles, p tiles fastest (adjacent memory),
        # so a program's next state load can be in flight while it finishes the current tile
        n_p = ct.cdiv(x.shape[3], BLOCK_P)
        nheads = x.shape[2]
        for t in range(ct.bid(0), x.shape[0] * nheads * n_p, ct.num_blocks(0)):
            rest = t // n_p
            _tile(state, x, dt, A, b, c, D, z, dt_bias, slots, out_states, y,
                  rest // nheads, rest % nheads, t % n_p, BLOCK_P, NP, HEADS_PER_GROUP,
                  DT_HEAD, A_HEAD, D_MODE, BIAS_MODE, HAS_Z, SOFTPLUS, HAS_IDX, HAS_OUT,
                  BLOCK_N, LATENCY, LOAD_TMA, STORE_TMA, VEC_TMA, IN_BOUNDS)
    else:
        _tile(state, x, dt, A, b, c, D, z, dt_bias, slots, out_states, y,
              ct.bid(0), ct.bid(1), ct.bid(2), BLOCK_P, NP, HEADS_PER_GROUP,
              DT_HEAD, A_HEAD, D_MODE, BIAS_MODE, HAS_Z, SOFTPLUS, HAS_IDX, HAS_OUT, BLOCK_N,
              LATENCY, LOAD_TMA, STORE_TMA, VEC_TMA, IN_BOUNDS)


state_update = ct.kernel(state_update_fn)
state_update_i64 = ct.kernel(int64_variant(
    state_update_fn, ["state", "x", "dt", "A", "b", "c", "D", "z", "dt_bias", "slots",
                      "out_states", "y"]))
