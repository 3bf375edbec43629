"""Layer benchmark: our `Mamba2` module (the fused layer function: cuTile convolution, scan and
gated norm, one autograd node) against the same layer composed of mamba_ssm's Triton pieces.

Shapes: d_model 768, 2560 and 4096 (8 groups at 4096), expand 2, d_conv 4, headdim 64,
dstate 128, chunk 256, norm after the gate (mamba_ssm's Mamba2 defaults), bf16 weights and
activations (D and A in float32), 8K to 64K tokens per step.

    ours        Mamba2(...)(u): in_proj -> mamba_split_conv1d_scan_combined (out_proj inside)
    composed    F.linear -> F.conv1d + SiLU -> mamba_ssm's Triton mamba_chunk_scan_combined
                -> mamba_ssm's Triton rmsnorm_fn -> F.linear, on the same parameters (the
                path mamba_ssm's Mamba2 takes without causal-conv1d's CUDA extension);
                skipped, with a note, when mamba_ssm is not importable

Modes: `train` = forward + backward (gradients of the input and every parameter), `decode` =
one `step` of one token at batch 1 and 64 (ours: causal_conv1d_update + selective_state_update;
composed: the conv state rolled in PyTorch, mamba_ssm's Triton selective_state_update, its
rmsnorm_fn). Times: CUDA graph replay after warm-up, L2 flushed, median (timing.time_graph);
eager medians when a capture fails (the row says which). Peak memory: max_memory_allocated
above the baseline around one forward + backward.

    python -m mamba2_cutile.bench.layer --out DIR [--models 768,2560,4096]
        [--tokens 8192,32768,65536] [--seqlen 8192] [--modes train,decode] [--reps 20]

writes DIR/layer.jsonl (one row per shape, impl and mode) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import traceback

import torch
import torch.nn.functional as F

from .timing import peak_memory_mib, time_eager, time_graph

#: (d_model, ngroups) of the three layer sizes
MODELS = {768: 1, 2560: 1, 4096: 8}
LAYER = dict(expand=2, d_conv=4, headdim=64, d_state=128, chunk_size=256)


def _mamba_ssm_pieces():
    """(mamba_chunk_scan_combined, rmsnorm_fn, selective_state_update) of mamba_ssm, or the
    reason they are not importable."""
    try:
        from mamba_ssm.ops.triton.layernorm_gated import rmsnorm_fn
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except Exception as e:  # noqa: BLE001 - a missing or broken baseline is a skipped column
        return None, f"mamba_ssm not importable: {type(e).__name__}: {e}"
    return (mamba_chunk_scan_combined, rmsnorm_fn, selective_state_update), None


def build_layer(d_model, ngroups, dtype=torch.bfloat16, device="cuda", seed=0):
    from ..layer import Mamba2

    torch.manual_seed(seed)
    return Mamba2(d_model, ngroups=ngroups, layer_idx=0, device=device, dtype=dtype, **LAYER)


def composed_forward(m, pieces):
    """forward(u) of the layer composed of PyTorch and mamba_ssm's Triton pieces, on m's
    parameters."""
    scan, rmsnorm_fn, _ = pieces

    def forward(u):
        b, l, _ = u.shape
        zxbcdt = F.linear(u, m.in_proj.weight, m.in_proj.bias)
        z0, x0, z, xBC, dt = m._split(zxbcdt)
        xBC = F.silu(F.conv1d(xBC.transpose(1, 2), m.conv1d.weight, m.conv1d.bias,
                              padding=m.d_conv - 1, groups=xBC.shape[-1])[..., :l]).transpose(1, 2)
        x, B, C = torch.split(xBC, [m.d_ssm, m.ngroups * m.d_state, m.ngroups * m.d_state],
                              dim=-1)
        y = scan(x.unflatten(-1, (m.nheads, m.headdim)), dt, m._A(),
                 B.unflatten(-1, (m.ngroups, m.d_state)), C.unflatten(-1, (m.ngroups, m.d_state)),
                 chunk_size=m.chunk_size, D=m._D(), dt_bias=m.dt_bias, dt_softplus=True)
        y = rmsnorm_fn(y.flatten(-2), m.norm.weight, None, z=z, eps=m.norm.eps,
                       group_size=m.d_ssm // m.ngroups, norm_before_gate=m.norm_before_gate)
        return F.linear(y, m.out_proj.weight, m.out_proj.bias)
    return forward


def composed_step(m, pieces):
    """step(u (b, 1, d_model), conv_state, ssm_state) of the composed layer."""
    _, rmsnorm_fn, state_update = pieces
    h, p, n = m.nheads, m.headdim, m.d_state

    def step(u, conv_state, ssm_state):
        b = u.shape[0]
        zxbcdt = F.linear(u[:, 0], m.in_proj.weight, m.in_proj.bias)
        z0, x0, z, xBC, dt = m._split(zxbcdt)
        conv_state.copy_(torch.roll(conv_state, shifts=-1, dims=-1))
        conv_state[:, :, -1] = xBC
        xBC = F.silu((conv_state * m.conv1d.weight[:, 0]).sum(-1) + m.conv1d.bias).to(u.dtype)
        x, B, C = torch.split(xBC, [m.d_ssm, m.ngroups * n, m.ngroups * n], dim=-1)
        y = state_update(ssm_state, x.view(b, h, p), dt[..., None].expand(b, h, p),
                         m._A()[:, None, None].expand(h, p, n), B.view(b, m.ngroups, n),
                         C.view(b, m.ngroups, n), m._D()[:, None].expand(h, p),
                         dt_bias=m.dt_bias[:, None].expand(h, p), dt_softplus=True)
        y = rmsnorm_fn(y.reshape(b, m.d_ssm), m.norm.weight, None, z=z, eps=m.norm.eps,
                       group_size=m.d_ssm // m.ngroups, norm_before_gate=m.norm_before_gate)
        return F.linear(y, m.out_proj.weight, m.out_proj.bias).unsqueeze(1)
    return step


def _time(fn, reps):
    """(median ms, method): CUDA graph replay, or eager if the capture fails."""
    try:
        return time_graph(fn, reps=reps, stream=torch.cuda.Stream())["median_ms"], "graph"
    except Exception:  # noqa: BLE001 - a call that cannot be captured is timed eagerly
        torch.cuda.synchronize()
        return time_eager(fn, reps=reps)["median_ms"], "eager"


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def bench_train(m, forward, batch, seqlen, reps):
    """forward + backward of forward(u) w.r.t. u and m's parameters; (row fields, out)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    u = torch.randn(batch, seqlen, m.d_model, generator=gen, device="cuda",
                    dtype=m.in_proj.weight.dtype).requires_grad_(True)
    dout = torch.randn(u.shape, generator=gen, device="cuda", dtype=u.dtype)
    params = [u] + list(m.parameters())

    def fwd_bwd():
        out = forward(u)
        return torch.autograd.grad(out, params, dout)

    out = forward(u).detach()
    fwd_ms, fwd_how = _time(lambda: forward(u.detach()), reps)
    ms, how = _time(fwd_bwd, reps)
    peak = peak_memory_mib(fwd_bwd)
    return dict(fwd_ms=fwd_ms, fwdbwd_ms=ms, timing=f"{fwd_how}/{how}", peak_mib=peak,
                tokens_per_s=batch * seqlen / (ms * 1e-3)), out


def bench_decode(m, step, batch, reps):
    conv_state, ssm_state = m.allocate_inference_cache(batch, 1)
    u = torch.randn(batch, 1, m.d_model, device="cuda", dtype=m.in_proj.weight.dtype)

    def one():
        with torch.no_grad():
            return step(u, conv_state, ssm_state)
    ms, how = _time(one, reps)
    return dict(step_ms=ms, timing=how)


def run(models=(768, 2560, 4096), tokens=(8192, 32768, 65536), seqlen=8192,
        modes=("train", "decode"), reps=20, decode_batches=(1, 64), out_rows=None, on_row=None):
    """The rows (dicts) of every shape, impl and mode; `on_row(row)` sees each as it is made
    (a run cut short keeps what it measured)."""
    pieces, why_not = _mamba_ssm_pieces()
    rows = []

    def add(row):
        rows.append(row)
        if on_row is not None:
            on_row(row)
    for d_model in models:
        ngroups = MODELS.get(d_model, 1)
        m = build_layer(d_model, ngroups)
        base = dict(d_model=d_model, ngroups=ngroups, nheads=m.nheads, **LAYER)
        for mode in modes:
            if mode == "train":
                for ntok in tokens:
                    l = min(seqlen, ntok)
                    b = max(1, ntok // l)
                    shape = dict(base, mode="train", batch=b, seqlen=l, tokens=b * l)
                    ref_out = None
                    for impl in ("ours", "composed"):
                        row = dict(shape, impl=impl)
                        if impl == "composed" and pieces is None:
                            add(dict(row, status="skipped", note=why_not))
                            continue
                        fwd = m if impl == "ours" else composed_forward(m, pieces)
                        try:
                            res, out = bench_train(m, fwd, b, l, reps)
                            row.update(res, status="ok")
                            if ref_out is None:
                                ref_out = out
                            else:
                                row["rel_diff_vs_ours"] = _rel(out, ref_out)
                        except Exception as e:  # noqa: BLE001 - one failed row, the rest go on
                            row.update(status="error", note=f"{type(e).__name__}: {e}"[:400],
                                       trace=traceback.format_exc(limit=3)[-800:])
                        add(row)
                        torch.cuda.empty_cache()
            elif mode == "decode":
                for batch in decode_batches:
                    shape = dict(base, mode="decode", batch=batch, seqlen=1, tokens=batch)
                    for impl in ("ours", "composed"):
                        row = dict(shape, impl=impl)
                        if impl == "composed" and pieces is None:
                            add(dict(row, status="skipped", note=why_not))
                            continue
                        step = m.step if impl == "ours" else composed_step(m, pieces)
                        try:
                            row.update(bench_decode(m, step, batch, max(reps, 50)), status="ok")
                        except Exception as e:  # noqa: BLE001
                            row.update(status="error", note=f"{type(e).__name__}: {e}"[:400])
                        add(row)
            else:
                raise ValueError(f"modes: unknown mode {mode!r} (train, decode)")
        del m
        torch.cuda.empty_cache()
    if out_rows is not None:
        out_rows.extend(rows)
    return rows


def _fmt(v, spec):
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def format_table(rows):
    """One line per shape and mode: ours, composed, speedup, peak memory."""
    lines = [f"{'d_model':>7} {'g':>2} {'mode':>6} {'batch':>5} {'seqlen':>6} | "
             f"{'ours ms':>9} {'composed ms':>11} {'speedup':>7} | {'ours MiB':>9} "
             f"{'comp. MiB':>9} | notes"]
    keyed = {}
    for r in rows:
        keyed.setdefault((r["d_model"], r["mode"], r["batch"], r["seqlen"]), {})[r["impl"]] = r
    for (d, mode, b, l), by in keyed.items():
        o, c = by.get("ours", {}), by.get("composed", {})
        key = "fwdbwd_ms" if mode == "train" else "step_ms"
        to, tc = o.get(key), c.get(key)
        speed = tc / to if (to and tc) else None
        notes = "; ".join(f"{k}: {v['note']}" for k, v in by.items() if v.get("note"))
        g = (o or c).get("ngroups", "")
        lines.append(f"{d:>7} {g:>2} {mode:>6} {b:>5} {l:>6} | {_fmt(to, '9.3f')} "
                     f"{_fmt(tc, '11.3f')} {_fmt(speed, '7.2f')} | "
                     f"{_fmt(o.get('peak_mib'), '9.0f')} {_fmt(c.get('peak_mib'), '9.0f')} | "
                     f"{notes[:120]}")
    return "\n".join(lines)


def _ints(s):
    return tuple(int(v) for v in s.split(",") if v)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m mamba2_cutile.bench.layer",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for layer.jsonl")
    ap.add_argument("--models", type=_ints, default=tuple(MODELS), help="d_model list")
    ap.add_argument("--tokens", type=_ints, default=(8192, 32768, 65536))
    ap.add_argument("--seqlen", type=int, default=8192, help="sequence length (batch = tokens / seqlen)")
    ap.add_argument("--modes", default="train,decode")
    ap.add_argument("--decode-batches", type=_ints, default=(1, 64))
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the layer benchmark needs a CUDA GPU")
    os.makedirs(args.out, exist_ok=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__)
    path = os.path.join(args.out, "layer.jsonl")
    with open(path, "w") as f:
        def write(r):
            f.write(json.dumps(dict(r, **meta), default=str) + "\n")
            f.flush()
        rows = run(args.models, args.tokens, args.seqlen, tuple(args.modes.split(",")),
                   args.reps, args.decode_batches, on_row=write)
    print(format_table(rows))
    ours = [r["tokens_per_s"] for r in rows
            if r.get("status") == "ok" and r["mode"] == "train" and r["impl"] == "ours"]
    if ours:
        print(f"median fwd+bwd tokens/s (ours): {statistics.median(ours):.3g}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
