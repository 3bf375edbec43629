"""The one home of the GPU tests' tolerances: bounds on max|got - ref| / max|ref| against the
float64 reference built from the same (rounded) inputs.

Each bound sits a few times (3-5x, more where a whole dtype shares one value) above the largest
error the GPU tests measured for it on an H200:
benchmarks/results/2026-11-30-h200-gpu-test-errors-forward-decode-backward.txt and the other
benchmarks/results/2026-11-30-h200-gpu-test-errors-*.txt files (-backward, -forward-decode-15ae6ba,
-decode-backward-dx-lowp). A check with no measured number yet uses its dtype's base value and
logs its error (support.gpu.log_result) so that the next GPU run measures it.

The mamba_ssm comparisons assert e <= MAMBA_FACTOR * e_mamba + comparison_floor(tol): never
more than 1.5x mamba_ssm's error on the same inputs, plus a floor of a tenth of the quantity's
own tolerance (where both errors are at rounding level).
"""

import torch

from mamba2_cutile.bench.accuracy import FORWARD_TOL

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

#: ours may be at most this many times mamba_ssm's error on the same inputs
MAMBA_FACTOR = 1.5


def comparison_floor(tol):
    """The absolute slack of a mamba_ssm comparison: a tenth of the quantity's tolerance."""
    return tol / 10


def base_tol(dtype):
    """A dtype's base tolerance (the forward's, by input dtype): bf16 2e-2, fp16 2e-3,
    fp32 2e-3 (measured at most 4.8e-3, 5.1e-4 and 6.3e-4 in the forward; 4.9e-3, 6.4e-4 and
    6.6e-4 in the backward's gradients other than the exceptions in grad_tol)."""
    return FORWARD_TOL[dtype]


def forward_tol(input_dtype):
    """The forward's outputs (out, final state, varlen states), by the input dtype (x's)."""
    return FORWARD_TOL[input_dtype]


def grad_tol(name, input_dtype, grad_dtype):
    """The backward's gradient of input `name` ("x", "dt", "A", "B", "C", "D", "z", "dt_bias",
    "initial_states"): the base by the input dtype (x's), except

    - dD 1e-6 when D (so its gradient) is float32: measured at most 1.8e-7 (a float32 sum);
      a bf16 D (the mixed-dtype test) gets a bf16-rounded gradient, so the base applies;
    - bf16 dA 5e-2: measured 1.01e-2 at (2, 333, 6, 3, 80, 96) chunk 256 (8.3e-3 at chunk 128);
    - fp32 ddt_bias and dB 5e-3: measured 1.16e-3 and 6.7e-4 in
      test_against_recurrence_autograd.
    """
    if name == "D" and grad_dtype == FP32:
        return 1e-6
    if name == "A" and input_dtype == BF16:
        return 5e-2
    if name in ("dt_bias", "B") and input_dtype == FP32:
        return 5e-3
    return base_tol(input_dtype)


#: decode results, by the dtype the result is stored in. bf16 1e-2 is about 2.6x the bf16
#: rounding ceiling (rounding alone gives up to 2^-8 = 3.9e-3; measured 3.5e-3 to 3.8e-3);
#: fp16 measured at most 2.4e-4; fp32 at most 2.0e-7
DECODE_TOL = {BF16: 1e-2, FP16: 1e-3, FP32: 1e-6}


def decode_tol(dtype):
    """Decode: y by x's dtype, the new state by the state's dtype, out_states by
    decode_out_states_tol."""
    return DECODE_TOL[dtype]


def decode_out_states_tol(out_dtype, state_dtype):
    """Decode out_states: by the coarser of its own dtype and the state's."""
    return max(DECODE_TOL[out_dtype], DECODE_TOL[state_dtype])


#: prefill (mamba_chunk_scan_combined over T tokens) then decode vs the bf16 scan over T + k
#: tokens: both sides are bf16-rounded, so the rounding ceiling is ~7.8e-3 (2 x 2^-8); measured
#: y 7.35e-3 (at that ceiling, 2.7x below this bound) and state 4.9e-3
PREFILL_DECODE_TOL = {"y": 2e-2, "state": 2e-2}

#: the float64 chunked backward formulas against float64 autograd: both exact up to float64
#: rounding (measured at most 1.9e-15)
FLOAT64_SELF_TOL = 1e-12

#: the same computation through 64- and 32-bit offsets (the int64_indexing tests; a wrapped
#: offset reads another batch entirely, an O(1) error): the same arithmetic in the same order,
#: so equal bits (measured 0.0 in the forward, backward and decode tests on 2026-12-01,
#: benchmarks/results/2026-12-01-h200-gpu-test-errors.txt)
SAME_MATH_TOL = 0.0

#: varlen_states and the final state at sequence edges (test_varlen_edges, bf16): at most
#: 1.1e-3 and 1.5e-3 measured on 2026-12-01
VARLEN_EDGES_TOL = 5e-3
