"""The problems whose plans cover every kernel variant the dispatchers pick, for the CPU compile
tests (and the machine-code comparisons): each list holds (name, keyword arguments of the
matching builder in `mamba2_cutile.bench.plans`)."""

import torch

from mamba2_cutile.bench import plans
from mamba2_cutile.decode import DecodeConfig
from mamba2_cutile.runtime import KernelCall
from mamba2_cutile.ssd.forward import SUPPORTED_CHUNK_SIZES


def forward_variants():
    """Problems whose plans cover the kernel variants the dispatcher picks, for the CPU
    compile check: every dtype x chunk size with all options on, then the tile sizes
    (headdim/dstate buckets), option subsets and 64-bit indexing at one dtype.

    Each item: (name, dict of problem parameters for `plans.forward_problem_plan`).
    """
    items = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for Q in SUPPORTED_CHUNK_SIZES:
            items.append((f"{str(dtype)[6:]}-Q{Q}-all", dict(dtype=dtype, chunk_size=Q)))
    bf = torch.bfloat16
    # 16 bits at chunk 256: long sequences are computed at chunk 128 (chunk_scan_group), short
    # ones keep chunk_scan at 256 (too few group programs for the SMs)
    for dtype in (torch.bfloat16, torch.float16):
        items.append((f"{str(dtype)[6:]}-Q256-short", dict(dtype=dtype, chunk_size=256,
                                                           seqlen=1000)))
    for (h, p, n) in ((8, 16, 16), (8, 32, 32), (64, 80, 64), (2, 256, 256), (128, 64, 96)):
        items.append((f"bf16-h{h}-p{p}-n{n}", dict(dtype=bf, nheads=h, headdim=p, dstate=n)))
    # without seq_idx the seed problem runs the walk (`walk_form`); 80 heads (320
    # programs, a part wave) keep the three-kernel forward without options
    items.append(("bf16-no-options", dict(dtype=bf, options=())))
    items.append(("bf16-D-head", dict(dtype=bf, options=("D_head",))))
    items.append(("bf16-no-options-h80", dict(dtype=bf, nheads=80, options=())))
    items.append(("bf16-D-head-h80", dict(dtype=bf, nheads=80, options=("D_head",))))
    items.append(("bf16-walk-whole-waves", dict(dtype=bf, batch=2, seqlen=8192, nheads=128,
                                                ngroups=8, options=("D_head", "z"))))
    items.append(("bf16-int64", dict(dtype=bf, int64=True)))
    items.append(("bf16-fp32-states-fp16-dt",
                  dict(dtype=bf, state_dtype=torch.float32, dt_dtype=torch.float16)))
    # tuning options a config may select
    items.append(("bf16-persistent", dict(dtype=bf, overrides=dict(scan_persistent=2))))
    items.append(("bf16-persistent-head-major", dict(dtype=bf, overrides=dict(
        scan_persistent=1, scan_head_major=1, scan_block_n=32))))
    items.append(("bf16-lowp-head-major", dict(dtype=bf, overrides=dict(scan_lowp=1,
                                                                       scan_head_major=1))))
    items.append(("fp16-lowp-Q256", dict(dtype=torch.float16, chunk_size=256,
                                         seqlen=1000, overrides=dict(scan_lowp=1))))
    items.append(("bf16-8-warps-occupancy-2", dict(dtype=bf, overrides=dict(
        scan_warps=8, scan_occupancy=2, state_occupancy=2))))
    items.append(("fp32-scale-x-Q256", dict(dtype=torch.float32, chunk_size=256,
                                            overrides=dict(state_scale_x=1))))
    items.append(("bf16-state-fresh-acc-p32", dict(dtype=bf, overrides=dict(
        state_fresh_acc=1, state_block_p=32))))
    items.append(("bf16-scan-occupancy-2-p32", dict(dtype=bf, overrides=dict(
        scan_occupancy=2, scan_block_p=32))))
    items.append(("bf16-Q256-scan-occupancy-2", dict(dtype=bf, chunk_size=256, seqlen=1000,
                                                     overrides=dict(scan_occupancy=2))))
    for bn in (32, 64):
        items.append((f"bf16-scan-block-n{bn}", dict(dtype=bf, overrides=dict(scan_block_n=bn))))
    items.append(("fp16-Q256-scan-block-n32-n96", dict(dtype=torch.float16, chunk_size=256,
                                                       dstate=96,
                                                       seqlen=1000,
                                                       overrides=dict(scan_block_n=32))))
    return items


def backward_variants():
    """Problems whose plans cover the kernel variants the dispatcher picks: every dtype x chunk
    size with all options on, then dstate/headdim buckets, option subsets, 64-bit indexing and
    the lowp option. Each item: (name, dict of parameters for `plans.backward_problem_plan`)."""
    items = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for Q in SUPPORTED_CHUNK_SIZES:
            items.append((f"{str(dtype)[6:]}-Q{Q}-all", dict(dtype=dtype, chunk_size=Q)))
    bf = torch.bfloat16
    items.append(("bf16-h8-g2-p80-n96", dict(dtype=bf, nheads=8, ngroups=2, headdim=80,
                                             dstate=96)))
    items.append(("bf16-h2-p256-n256", dict(dtype=bf, nheads=2, headdim=256, dstate=256)))
    items.append(("bf16-no-options", dict(dtype=bf, options=())))
    items.append(("bf16-D-head", dict(dtype=bf, options=("D_head", "init"))))
    items.append(("bf16-int64", dict(dtype=bf, int64=True)))
    items.append(("bf16-lowp", dict(dtype=bf, overrides=dict(lowp=1, dx_lowp=1))))
    items.append(("bf16-fp32-operands", dict(dtype=bf, overrides=dict(lowp=0, dx_lowp=0))))
    items.append(("bf16-unfused-stable-da", dict(dtype=bf, overrides=dict(bc_fused=0,
                                                                           da_mode=0))))
    items.append(("bf16-split-da-latency", dict(dtype=bf, overrides=dict(
        da_mode=2, bc_fused=1, bstate_load_latency=4, dx_load_latency=4, bc_load_latency=4))))
    items.append(("bf16-fp16-dt-bf16-states", dict(dtype=bf, dt_dtype=torch.float16,
                                                   state_dtype=torch.bfloat16)))
    # short sequences: the dispatcher splits the fused dB/dC launch's heads (12 programs of 2)
    items.append(("bf16-T512-h24-head-split", dict(dtype=bf, batch=1, seqlen=512, nheads=24,
                                                   chunk_size=256)))
    items.append(("bf16-int64-head-split", dict(dtype=bf, int64=True, overrides=dict(
        bc_head_split=2, da_mode=2, bc_fused=1))))
    # the whole-chunk fused dB/dC launch at long sequences too (bc_fused 1)
    items.append(("bf16-fused-dbc", dict(dtype=bf, overrides=dict(bc_fused=1, da_mode=1,
                                                                       bc_block_q=64))))
    # dB and dC through the gradient of the groups' C B^T (bc_fused 2) with the per-token da
    # terms in bwd_chunk_dx (da_mode 1; the rule's da_mode 3 is below)
    items.append(("bf16-group-dcb", dict(dtype=bf, overrides=dict(bc_fused=2, da_mode=1))))
    items.append(("bf16-int64-group-dcb", dict(dtype=bf, int64=True, overrides=dict(
        bc_fused=2, da_mode=1, dcb_occupancy=4))))
    # the decay gradient's W terms in bwd_chunk_dcb (da_mode 3), with and without z
    items.append(("bf16-group-dcb-da3", dict(dtype=bf, overrides=dict(
        bc_fused=2, da_mode=3, bc_block_q=32, dcb_occupancy=4, bc_occupancy=2, bc_warps=4))))
    items.append(("bf16-group-dcb-da3-no-z", dict(dtype=bf, options=("D_head",), overrides=dict(
        bc_fused=2, da_mode=3, bc_block_q=32, dcb_occupancy=4, bc_occupancy=2, bc_warps=4))))
    items.append(("bf16-int64-group-dcb-da3", dict(dtype=bf, int64=True, overrides=dict(
        bc_fused=2, da_mode=3))))
    # the dS and dB/dC launches with each group's heads split (dcb_head_split), at a short
    # sequence (its fp32 dB/dC partials) and past 2^31 elements
    items.append(("bf16-T2K-h64-dcb-head-split", dict(dtype=bf, batch=1, seqlen=2048,
                                                      nheads=64, chunk_size=256,
                                                      overrides=dict(dcb_head_split=4))))
    items.append(("bf16-int64-dcb-head-split", dict(dtype=bf, int64=True, overrides=dict(
        bc_fused=2, da_mode=3, dcb_head_split=2))))
    # the dispatcher computes a chunk-256 backward at chunk 128; 256 stays selectable
    items.append(("bf16-Q256-internal-256", dict(dtype=bf, chunk_size=256,
                                                 overrides=dict(chunk_size=256))))
    return items


def decode_variants():
    """(name, problem dict for `plans.decode_problem_plan`): every flag value at least once, the int64
    variant, and the tile-size buckets (NP 16 / 128 / 256, p not a power of two, BLOCK_P 1)."""
    bf, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    return [
        ("mamba2-bf16-idx", dict(dtype=bf, state_dtype=bf, layout="head",
                                 options=("D", "z", "bias", "softplus", "idx"))),
        ("mamba2-fp32state-k4-out", dict(dtype=bf, state_dtype=f32, layout="head", k=4,
                                         options=("D", "z", "bias", "softplus", "idx", "out"))),
        ("general-bf16", dict(dtype=bf, state_dtype=bf, layout="general",
                              options=("D", "bias"))),
        ("none-fp16", dict(dtype=f16, state_dtype=f16, layout="head", options=())),
        ("mixed-headD-chanbias", dict(dtype=bf, state_dtype=f32, layout="mixed",
                                      options=("D", "bias", "softplus", "z"))),
        ("int64-state", dict(dtype=bf, state_dtype=bf, layout="head", int64=True,
                             options=("D", "z", "bias", "softplus", "idx"))),
        ("odd-p80-n96", dict(dtype=bf, state_dtype=f32, layout="head", nheads=6, ngroups=3,
                             headdim=80, dstate=96, options=("D", "z", "idx"))),
        ("small-p16-n16", dict(dtype=f32, state_dtype=f32, layout="general", nheads=4,
                               ngroups=1, headdim=16, dstate=16, k=2,
                               options=("D", "out"))),
        ("tiny-p1-n1", dict(dtype=bf, state_dtype=bf, layout="head", nheads=2, ngroups=1,
                            headdim=1, dstate=1, options=("D", "z", "bias", "softplus", "idx"))),
        ("n256-p128", dict(dtype=bf, state_dtype=bf, layout="head", nheads=16, ngroups=2,
                           headdim=128, dstate=256, options=("D", "z", "bias", "softplus"))),
        ("persistent-bf16-idx", dict(dtype=bf, state_dtype=bf, layout="head", options=(
            "D", "z", "bias", "softplus", "idx"), config=DecodeConfig(
                block_p=32, dstate_pad=128, occupancy=4, persistent=4))),
        ("split-n-bf16-out", dict(dtype=bf, state_dtype=bf, layout="head", options=(
            "D", "z", "bias", "softplus", "idx", "out"), config=DecodeConfig(
                block_p=32, dstate_pad=128, occupancy=8, block_n=32))),
        ("split-n-general-n96", dict(dtype=bf, state_dtype=f32, layout="general", nheads=6,
                                     ngroups=3, headdim=80, dstate=96, options=("D", "bias"),
                                     config=DecodeConfig(block_p=16, dstate_pad=128,
                                                         block_n=64, persistent=2))),
        ("flat-no-tma-idx", dict(dtype=bf, state_dtype=bf, layout="head", options=(
            "D", "z", "bias", "softplus", "idx"), config=DecodeConfig(
                block_p=64, dstate_pad=128, occupancy=4, tma=0, flat=1))),
        ("tma-load-only", dict(dtype=bf, state_dtype=bf, layout="head", options=(
            "D", "z", "bias", "softplus", "idx"), config=DecodeConfig(
                block_p=64, dstate_pad=128, occupancy=4, tma=2))),
        ("checked-tma-load-only", dict(dtype=bf, state_dtype=bf, layout="head", options=(
            "D", "z", "bias", "softplus"), config=DecodeConfig(
                block_p=64, dstate_pad=128, occupancy=4, tma=2, unchecked=0))),
        ("checked-no-tma-idx", dict(dtype=bf, state_dtype=bf, layout="head", options=(
            "D", "z", "bias", "softplus", "idx"), config=DecodeConfig(
                block_p=64, dstate_pad=128, occupancy=4, tma=0, unchecked=0))),
        ("latency-no-tma", dict(dtype=bf, state_dtype=bf, layout="head", options=(
            "D", "z", "bias", "softplus", "idx"), config=DecodeConfig(
                block_p=32, dstate_pad=128, occupancy=8, latency=4, tma=0))),
        ("split-n-latency", dict(dtype=bf, state_dtype=bf, layout="head", options=(
            "D", "z", "bias", "softplus"), config=DecodeConfig(
                block_p=32, dstate_pad=128, occupancy=8, block_n=64, latency=2))),
        ("no-tma-vec", dict(dtype=bf, state_dtype=bf, layout="head", options=(
            "D", "z", "bias", "softplus"), config=DecodeConfig(
                block_p=64, dstate_pad=128, occupancy=4, tma=0, tma_vec=0))),
        ("split-n-no-tma", dict(dtype=bf, state_dtype=f32, layout="head", options=("D",),
                                config=DecodeConfig(block_p=32, dstate_pad=128, occupancy=8,
                                                    block_n=32, tma=0, tma_vec=0))),
    ]

#: family -> (variant list, plan builder)
PROVIDERS = {
    "forward": (forward_variants, plans.forward_problem_plan),
    "backward": (backward_variants, plans.backward_problem_plan),
    "decode": (decode_variants, plans.decode_problem_plan),
}


def kernel_arg(call, name):
    """The value a planned launch passes for the kernel parameter `name`."""
    fn = call.kernel._annotated_function.pyfunc
    return call.args[fn.__code__.co_varnames[:fn.__code__.co_argcount].index(name)]


def kernel_name(call) -> str:
    return call.kernel._annotated_function.pyfunc.__name__.removesuffix("_fn")


def variant_of(call: KernelCall) -> dict:
    """The compile-time flags of a planned launch, by parameter name, plus "int64"."""
    fn = call.kernel._annotated_function.pyfunc
    names = fn.__code__.co_varnames[:fn.__code__.co_argcount]
    flags = {name: v for name, v in zip(names, call.args) if not isinstance(v, torch.Tensor)}
    flags["int64"] = fn.__annotations__.get("state") is _int64_annotation()
    return flags


def _int64_annotation():
    import cuda.tile as ct
    return ct.IndexedWithInt64


def signature_key(call, arch):
    """What decides a launch's machine code: the kernel object (its function, 64-bit variant and
    hints), the constants, and what the JIT knows of each array (dtype, rank, unit strides,
    16-byte divisibility of strides and sizes); `arch`."""
    def describe(a):
        if isinstance(a, torch.Tensor):
            per16 = max(1, 16 // a.element_size())
            return (a.dtype, a.dim(), tuple(s == 1 for s in a.stride()),
                    tuple(s % per16 == 0 for s in a.stride()), tuple(d % 16 == 0 for d in a.shape))
        return (type(a).__name__, a if isinstance(a, (bool, int)) else None)
    return (id(call.kernel), arch, tuple(describe(a) for a in call.args))


#: variants also compiled for sm_100 in the default run (the rest of sm_100 is marked slow:
#: a portability check of the same source, 10-30 s a compile on 2 cores without a cache, where
#: sm_90 is the tested target): bf16 with all options at chunk 256 (forward) and 128 (the
#: backward's internal chunk), and the decode kernel's bf16 Mamba-2 layout
SM100_DEFAULT = {"forward": lambda name: name == "bfloat16-Q256-all",
                 "backward": lambda name: name == "bfloat16-Q128-all",
                 "decode": lambda name: name == "mamba2-bf16-idx"}


#: sm_90 variants compiled only in the slow run (MAMBA2_TEST_SLOW=1): fp16, float32 but at
#: chunk 128, the small power-of-two headdim / dstate buckets, and the tuning options no
#: rule picks (5-50 s a variant on 2 cores without a cache). The default run compiles the
#: variants the dispatchers pick in bf16 (each chunk, int64, the walk, headdim 80 / dstate
#: 64 and 96, 256 / 256, the short-sequence and head-split backward) and float32 at 128.
SLOW_VARIANTS = {
    "forward": {
        "float16-Q64-all", "float16-Q128-all", "float16-Q256-all", "float16-Q256-short",
        "float32-Q64-all", "float32-Q256-all", "bf16-h8-p16-n16", "bf16-h8-p32-n32",
        "bf16-h128-p64-n96", "bf16-fp32-states-fp16-dt", "bf16-persistent",
        "bf16-persistent-head-major", "bf16-lowp-head-major", "fp16-lowp-Q256",
        "bf16-8-warps-occupancy-2", "fp32-scale-x-Q256", "bf16-state-fresh-acc-p32",
        "bf16-scan-occupancy-2-p32", "bf16-Q256-scan-occupancy-2", "bf16-scan-block-n32",
        "bf16-scan-block-n64", "fp16-Q256-scan-block-n32-n96"},
    "backward": {
        "float16-Q64-all", "float16-Q256-all", "float32-Q64-all", "float32-Q256-all",
        "bf16-lowp", "bf16-fp32-operands", "bf16-unfused-stable-da", "bf16-split-da-latency",
        "bf16-fp16-dt-bf16-states", "bf16-int64-head-split", "bf16-fused-dbc",
        "bf16-group-dcb", "bf16-int64-group-dcb", "bf16-group-dcb-da3-no-z"},
    "decode": set(),
}


def is_slow_variant(family, name, arch) -> bool:
    """Whether the default run skips compiling `family`'s variant `name` for `arch`."""
    if arch != "sm_90":
        return not SM100_DEFAULT[family](name)
    return name in SLOW_VARIANTS[family]


def distinct_launches(families, arch):
    """[(test id, family, variant name, launch index, slow)] of every launch of `families`'
    variants whose machine code is not already covered by an earlier one (same
    `signature_key`): the backward's recompute launches are the forward's kernels, many
    variants share kernels. The default run's variants come first, so that a launch they
    share with a slow variant is compiled by default."""
    seen, out = set(), []
    for slow in (False, True):
        for family in families:
            variants, plan = PROVIDERS[family]
            for name, problem in variants():
                if is_slow_variant(family, name, arch) != slow:
                    continue
                for i, call in enumerate(plan(**problem)):
                    key = signature_key(call, arch)
                    if key in seen:
                        continue
                    seen.add(key)
                    out.append((f"{family}-{name}-{kernel_name(call)}", family, name, i, slow))
    return out


def launch_of(family, name, index):
    variants, plan = PROVIDERS[family]
    return plan(**dict(variants())[name])[index]
