"""Host time of planning one scan call: the Python work before the kernel launches.

    python3 scripts/plan_time.py [--reps 300] [--device meta]

In eager PyTorch a short scan is host-bound (at 2 x 8192 tokens, 24 heads the forward's
kernels take 0.22 ms on an H200, its eager call 0.56 ms), so every microsecond spent building
the plan is one the GPU waits. This times, per call, what runs before `ct.launch`: argument
validation, the dispatcher's config, the kernel-ready inputs, buffers and launch plan of the
forward (`forward_launches`) and of the backward (`run_backward` with the launches skipped),
on `meta` tensors by default (no GPU needed; on a CUDA device pass --device cuda). Median and
minimum of --reps calls, in microseconds, per shape.

Then the dispatch of the scan's forward with autograd, on meta tensors with the op's fake
implementation as the body: through `torch.ops.mamba2_cutile.ssd_forward` (torch.library's
dispatch and generated autograd) against the eager path's autograd.Function (`_EagerScan`'s, on the
fake body), and the body alone.
"""
import argparse
import statistics
import time

import torch

from mamba2_cutile.eager import eager_function
from mamba2_cutile.runtime import DEFAULT_SMS
from mamba2_cutile.ssd import backward, custom_ops
from mamba2_cutile.ssd.api import _validate
from mamba2_cutile.ssd.forward import forward_launches

SHAPES = {  # name: (batch, seqlen, heads, groups, headdim, dstate, chunk)
    "130m-T512": (1, 512, 24, 1, 64, 128, 256),
    "130m-T8K": (2, 8192, 24, 1, 64, 128, 256),
    "7b-class-T8K": (2, 8192, 128, 8, 64, 128, 256),
}


def inputs(dims, device, options):
    b, l, h, g, p, n, _ = dims
    e = lambda *s, dt=torch.bfloat16: torch.empty(s, dtype=dt, device=device)  # noqa: E731
    f32 = torch.float32
    t = dict(x=e(b, l, h, p), dt=e(b, l, h, dt=f32), A=e(h, dt=f32), B=e(b, l, g, n),
             C=e(b, l, g, n), D=e(h, dt=f32), z=None, dt_bias=None, initial_states=None)
    if "options" in options:
        t.update(z=e(b, l, h, p), dt_bias=e(h, dt=f32), initial_states=e(b, h, p, n, dt=f32))
    return t


def time_us(fn, reps):
    """(median, min) of `reps` calls in microseconds (the min: the least disturbed call)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6, min(times) * 1e6


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--device", default="meta")
    args = ap.parse_args(argv)
    print(f"torch {torch.__version__}, device {args.device}, {args.reps} calls: median / min (us)")
    print(f"{'shape':<14} {'inputs':<8} {'validate':>13} {'forward':>13} {'backward':>13}")
    for name, dims in SHAPES.items():
        for options in ("D", "options"):
            t = inputs(dims, args.device, options)
            x, dt, A, B, C, D = (t[k] for k in ("x", "dt", "A", "B", "C", "D"))
            z, bias, init = t["z"], t["dt_bias"], t["initial_states"]
            Q = dims[-1]
            val = time_us(lambda: _validate(x, dt, A, B, C, Q, D, z, bias, init, None, None,
                                              (0.0, float("inf")), False, None), args.reps)
            fwd = time_us(lambda: forward_launches(x, dt, A, B, C, Q, D=D, z=z, dt_bias=bias,
                                                     initial_states=init,
                                                     dt_softplus=bias is not None), args.reps)
            dout = torch.empty_like(x)
            bwd = time_us(lambda: backward.run_backward(
                x, dt, A, B, C, Q, dout, None, D=D, z=z, dt_bias=bias, initial_states=init,
                dt_softplus=bias is not None, launch_fn=lambda calls: None,
                sms=DEFAULT_SMS), args.reps)
            cols = " ".join(f"{m:>6.0f} /{lo:>5.0f}" for m, lo in (val, fwd, bwd))
            print(f"{name:<14} {options:<8} {cols}")
    dispatch(args.reps)


def dispatch(reps):
    t = inputs(SHAPES["130m-T8K"], "meta", "D")
    x = t["x"].requires_grad_(True)
    args = (x, t["dt"], t["A"], t["B"], t["C"], 256, t["D"], None, None, None, None, None,
            False, 0.0, float("inf"), torch.bfloat16)
    fake = custom_ops._forward_fake
    timed = eager_function("_EagerScanFake", fake, custom_ops._setup_context,
                           custom_ops._backward_eager)
    rows = [("custom op", lambda: custom_ops.ssd_forward(*args)),
            ("_EagerScan", lambda: timed.apply(*args)),
            ("body alone", lambda: fake(*args))]
    print("dispatch of the forward with autograd (130m-T8K, meta, fake body): median / min")
    for label, fn in rows:
        med, lo = time_us(fn, reps)
        print(f"  {label:<12} {med:>6.0f} /{lo:>5.0f}")


if __name__ == "__main__":
    main()
