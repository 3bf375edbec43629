"""mamba2-cutile: Mamba-2 SSD kernels in NVIDIA cuTile, a drop-in for mamba_ssm's chunked scan."""

from .decode import selective_state_update
from .ssd import mamba_chunk_scan_combined

__version__ = "0.1.0"
__all__ = ["mamba_chunk_scan_combined", "selective_state_update", "__version__"]
