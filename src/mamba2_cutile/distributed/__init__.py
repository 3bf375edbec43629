"""Context parallelism: one sequence across several ranks (`chunk_scan_cp`), only the SSD's
states (heads x headdim x dstate per row) crossing the wire; `simulate_ranks` runs the same two
stages for all ranks in one process, the exchange done by hand."""

from .context_parallel import bytes_sent_per_rank, chunk_scan_cp, simulate_ranks

__all__ = ["chunk_scan_cp", "simulate_ranks", "bytes_sent_per_rank"]
