"""The implementations the benchmark compares, each a forward closure over the same inputs
returning (out, final_state), or None when it is not importable or cannot run the shape."""

from __future__ import annotations


def ours(inp, chunk):
    from mamba2_cutile import mamba_chunk_scan_combined

    def fwd():
        return mamba_chunk_scan_combined(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"],
                                         chunk, D=inp["D"], initial_states=inp["initial_states"],
                                         return_final_states=True)
    return fwd


def mamba_ssm(inp, chunk):
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined as f
    except Exception:  # noqa: BLE001
        return None

    def fwd():
        return f(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], chunk, D=inp["D"],
                 initial_states=inp["initial_states"], return_final_states=True)
    return fwd


def tilegym(inp, chunk):
    try:
        from tilegym.ops.cutile.mamba2 import mamba2_chunk_forward as f
    except Exception:  # noqa: BLE001
        return None
    if inp["x"].shape[1] % chunk:
        return None                       # TileGym needs T divisible by the chunk size

    def fwd():
        return f(inp["x"], inp["A"], inp["B"], inp["C"], inp["D"], inp["dt"],
                 inp["initial_states"], chunk_size=chunk)
    return fwd


def versions():
    import torch
    v = {"torch": torch.__version__}
    try:
        import cuda.tile as ct
        v["cuda-tile"] = ct.__version__
    except Exception:  # noqa: BLE001
        v["cuda-tile"] = None
    try:
        import triton
        v["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        v["triton"] = None
    if torch.cuda.is_available():
        v["gpu"] = torch.cuda.get_device_name()
        v["cuda"] = torch.version.cuda
    return v


IMPLS = {"mamba2-cutile": ours, "mamba_ssm": mamba_ssm, "tilegym": tilegym}
