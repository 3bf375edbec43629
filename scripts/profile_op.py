"""One layer op at a shape, run a few times for a profiler (ncu) to read its kernels, and timed.

    python3 scripts/profile_op.py OP SHAPE [--reps N]
    ncu --clock-control none -k regex:conv1d -c 2 python3 scripts/profile_op.py conv1d-fwd 1x16384x5376

OP and SHAPE:
    conv1d-fwd, conv1d-bwd   BxTxD    causal_conv1d_fn (bias, SiLU, width 4, channel-last slice
                                      of a wider projection, as the layer passes it), bf16
    norm-fwd, norm-bwd       TxHxG    rmsnorm_fn with z (norm before gate; --gate-first: the
                                      Mamba-2 layer's order), G groups, bf16
    copy, copy-tma           RxC:BRxBC  a cuTile tile copy of an (R, C) bf16 array in (BR, BC)
                                      tiles: what a load + store at that tile shape reaches

Prints the kernel time (CUDA graph, L2 flushed, median) and the bandwidth it implies, so a run
without a profiler gives the numbers beside the profile's.
"""
import argparse

import torch

import cuda.tile as ct


def _copy_kernel(src, dst, BR: ct.Constant[int], BC: ct.Constant[int], TMA: ct.Constant[bool]):
    i = ct.bid(0)
    j = ct.bid(1)
    t = ct.load(src, index=(i, j), shape=(BR, BC), allow_tma=TMA)
    ct.store(dst, index=(i, j), tile=t, allow_tma=TMA)


copy_kernel = ct.kernel(_copy_kernel)


def _op(name, shape, gate_first=False):
    from mamba2_cutile.bench import conv1d as bc
    from mamba2_cutile.bench import norm as bn
    if name.startswith("conv1d"):
        b, t, d = (int(v) for v in shape.split("x"))
        x, w, bias, dout = bc.make_inputs(b, t, d)
        nbytes = bc.conv1d_bytes(x, "fwd")
        if name == "conv1d-fwd":
            from mamba2_cutile.conv1d import causal_conv1d_fn
            return (lambda: causal_conv1d_fn(x, w, bias, activation="silu")), nbytes
        from mamba2_cutile.conv1d import plan
        xk, cl = plan.kernel_layout(x)
        cfg = plan.conv1d_config(xk.shape[0], xk.shape[1], xk.shape[2], cl)
        # backward bytes: x and dout read, dx written (3 passes; the forward's 2 is nbytes)
        return bc._bwd_runner(x, w, bias, dout, cfg)[0], nbytes * 3 // 2
    if name.startswith("norm"):
        t, h, g = (int(v) for v in shape.split("x"))
        x, z, w, dout = bn.make_inputs(t, h)
        fb, bb = bn.norm_bytes(t, h, g)
        if name == "norm-fwd":
            from mamba2_cutile.norm import rmsnorm_fn
            return (lambda: rmsnorm_fn(x, w, None, z=z, eps=1e-5, group_size=h // g,
                                       norm_before_gate=not gate_first)), fb
        return bn._ours_bwd(x, z, w, dout, h // g, not gate_first), bb
    if name in ("copy", "copy-tma"):
        dims, tiles = shape.split(":")
        r, c = (int(v) for v in dims.split("x"))
        br, bcol = (int(v) for v in tiles.split("x"))
        if r % br or c % bcol:
            raise SystemExit(f"copy: the tiles {br}x{bcol} must divide the array {r}x{c}")
        src = torch.randn(r, c, device="cuda").to(torch.bfloat16)
        dst = torch.empty_like(src)
        grid = (r // br, c // bcol, 1)
        args = (src, dst, br, bcol, name == "copy-tma")
        # the current stream at call time: a CUDA graph captures on its own stream
        return (lambda: ct.launch(torch.cuda.current_stream(), grid, copy_kernel, args)), \
            2 * src.numel() * 2
    raise SystemExit(f"unknown op {name!r}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("op")
    ap.add_argument("shape")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--profile", action="store_true", help="run 3 times, no timing (for ncu)")
    ap.add_argument("--gate-first", action="store_true",
                    help="norm ops: norm(x * silu(z)) (norm_before_gate=False)")
    a = ap.parse_args()
    fn, nbytes = _op(a.op, a.shape, a.gate_first)
    if a.profile:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        print("done", a.op, a.shape)
        return
    from mamba2_cutile.bench.timing import time_graph
    ms = time_graph(fn, reps=a.reps)["median_ms"]
    gbs = nbytes / (ms * 1e-3) / 1e9
    print(f"{a.op:<11} {a.shape:<22} {ms:8.4f} ms  {gbs:7.0f} GB/s  "
          f"{100 * gbs / 4300:5.1f}% of 4.3 TB/s")


if __name__ == "__main__":
    main()
