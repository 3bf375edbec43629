"""The sum over programs of a backward's per-program partial sums (dweight, dbias), cast to the
parameter's dtype, in one launch and a fixed order (deterministic).

    out[r, n] = sum_p parts[p, r, n]          (float32 accumulation, then out's dtype)

parts (P, R, N) float32; out (R, N) any strides (the conv1d's dweight is written through its
transposed view). Program (r * cdiv(N, BLOCK_N) + j, 0, k) sums column block j (BLOCK_N
columns) of row r of the k-th pair (k = 1: parts2 / out2, the bias, whose R may be smaller:
rows past it return). It walks P in BLOCK_P-row tiles, adding them into one (BLOCK_P, BLOCK_N)
accumulator, and reduces it over its rows once at the end, so the order of the additions is
fixed by the tile shapes alone. Rows past P and columns past N load as zeros; columns past N
are not stored.

Why a kernel: `parts.sum(0)` and the cast to the parameter's dtype are two launches per
tensor (four with a bias, five for the conv1d's transposed dweight), each a few microseconds
of launch gap and tail beside a backward of 50-300 us.
Grid: (cdiv(N, BLOCK_N) * R, 1, 2 if TWO else 1): the rows on the first axis, whose limit is
2^31 - 1 (the second's is 65535: the split dB/dC partials of the backward have B * L rows).
"""

import cuda.tile as ct

from ._common import int64_variant


def _sum_rows(parts, out, col_blk, r, BLOCK_P: ct.Constant[int], BLOCK_N: ct.Constant[int]):
    acc = ct.full((BLOCK_P, BLOCK_N), 0.0, dtype=ct.float32)
    for i in range(ct.cdiv(parts.shape[0], BLOCK_P)):
        t = ct.load(parts, index=(i, r, col_blk), shape=(BLOCK_P, 1, BLOCK_N),
                    padding_mode=ct.PaddingMode.ZERO)
        acc = acc + t.reshape((BLOCK_P, BLOCK_N))
    total = ct.sum(acc, axis=0, keepdims=True)
    ct.store(out, index=(r, col_blk), tile=total.astype(out.dtype))


def sum_partials_fn(
    parts,       # (P, R, N) float32
    out,         # (R, N)
    parts2,      # (P, R2, N) float32, R2 <= R (read only when TWO)
    out2,        # (R2, N)
    BLOCK_P: ct.Constant[int],
    BLOCK_N: ct.Constant[int],
    TWO: ct.Constant[bool],
):
    n_blk = ct.cdiv(out.shape[1], BLOCK_N)
    col_blk = ct.bid(0) % n_blk
    r = ct.bid(0) // n_blk
    if TWO and ct.bid(2) == 1:
        if r < parts2.shape[1]:
            _sum_rows(parts2, out2, col_blk, r, BLOCK_P, BLOCK_N)
    else:
        _sum_rows(parts, out, col_blk, r, BLOCK_P, BLOCK_N)


sum_partials = ct.kernel(sum_partials_fn)
sum_partials_i64 = ct.kernel(int64_variant(sum_partials_fn, ["parts", "out", "parts2", "out2"]))
