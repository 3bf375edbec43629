"""The Mamba-2 layer: `mamba_split_conv1d_scan_combined` (everything between the input and the
output projection in one autograd node, a drop-in for mamba_ssm's function of that name) and
the `Mamba2` module (mamba_ssm's parameters and state-dict keys, training forward, prefill and
decode with an inference cache)."""

from .fused import mamba_split_conv1d_scan_combined
from .module import InferenceParams, Mamba2

__all__ = ["mamba_split_conv1d_scan_combined", "Mamba2", "InferenceParams"]
