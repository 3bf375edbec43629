"""The Mamba-2 SSD chunked scan: `mamba_chunk_scan_combined` (api), its custom ops and autograd
(custom_ops), the forward and backward launch plans on CUDA tensors (forward, backward) and the
varlen states (varlen)."""

from .api import mamba_chunk_scan_combined

__all__ = ["mamba_chunk_scan_combined"]
