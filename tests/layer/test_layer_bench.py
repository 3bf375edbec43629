"""CPU: the layer benchmark's baseline composition and decode step (bench/layer.py), run with
this library's pieces standing in for mamba_ssm's, equal our Mamba2 forward and step; the
table formats every row kind."""

import torch

from mamba2_cutile import mamba_chunk_scan_combined, selective_state_update
from mamba2_cutile.bench import layer as bench_layer
from mamba2_cutile.layer import Mamba2
from mamba2_cutile.norm import rmsnorm_fn

PIECES = (mamba_chunk_scan_combined, rmsnorm_fn, selective_state_update)


def small():
    torch.manual_seed(0)
    return Mamba2(16, d_state=8, headdim=4, ngroups=2, chunk_size=64, layer_idx=0,
                  dtype=torch.float64)


def test_composed_forward_equals_module():
    m = small()
    u = torch.randn(2, 40, 16, dtype=torch.float64)
    torch.testing.assert_close(bench_layer.composed_forward(m, PIECES)(u), m(u), rtol=3e-15,
                               atol=3e-15)   # measured 6.7e-16


def test_composed_step_equals_module_step():
    m = small()
    u = torch.randn(3, 1, 16, dtype=torch.float64)
    ours = m.allocate_inference_cache(3, 1)
    theirs = m.allocate_inference_cache(3, 1)
    for _ in range(3):
        a, *_ = m.step(u, *ours)
        b = bench_layer.composed_step(m, PIECES)(u, *theirs)
        torch.testing.assert_close(b, a, rtol=0, atol=0)   # the same operations: equal
    torch.testing.assert_close(theirs[0], ours[0], rtol=0, atol=0)


def test_format_table_rows():
    base = dict(d_model=768, ngroups=1, batch=1, seqlen=8192)
    rows = [dict(base, mode="train", impl="ours", fwdbwd_ms=2.0, peak_mib=100.0, status="ok"),
            dict(base, mode="train", impl="composed", status="skipped", note="mamba_ssm not importable"),
            dict(base, mode="decode", batch=64, seqlen=1, impl="ours", step_ms=0.1, status="ok"),
            dict(base, mode="decode", batch=64, seqlen=1, impl="composed", step_ms=0.2,
                 status="ok")]
    text = bench_layer.format_table(rows)
    assert "mamba_ssm not importable" in text and "2.000" in text and "2.00" in text
