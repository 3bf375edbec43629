"""mamba2-cutile: the Mamba-2 layer in NVIDIA cuTile. The SSD chunked scan (a drop-in for
mamba_ssm's `mamba_chunk_scan_combined`), its decode step, the causal conv1d, the gated RMSNorm,
the fused layer function and the `Mamba2` module; context parallelism in `.distributed`, the
Hugging Face transformers integration in `.integrations.transformers`."""

from .conv1d import causal_conv1d_fn, causal_conv1d_update
from .decode import selective_state_update
from .layer import InferenceParams, Mamba2, mamba_split_conv1d_scan_combined
from .norm import RMSNorm, rmsnorm_fn
from .ssd import mamba_chunk_scan_combined
from . import distributed  # noqa: F401  (mamba2_cutile.distributed.chunk_scan_cp)

__version__ = "0.1.0"
__all__ = ["mamba_chunk_scan_combined", "selective_state_update", "causal_conv1d_fn",
           "causal_conv1d_update", "rmsnorm_fn", "RMSNorm", "mamba_split_conv1d_scan_combined",
           "Mamba2", "InferenceParams", "__version__"]
