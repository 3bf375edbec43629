"""PyTorch definitions, independent of the kernels: the SSD recurrence (the ground truth), the
chunked SSD (the CPU path), the explicit chunked backward stages (the backward kernels'
blueprint and the CPU backward) and the decode step."""

from .chunked import ssd_chunked
from .chunked_backward import ssd_chunked_backward
from .common import process_dt
from .decode import selective_state_update_ref
from .recurrence import ssd_recurrence

__all__ = ["ssd_recurrence", "ssd_chunked", "ssd_chunked_backward", "process_dt",
           "selective_state_update_ref"]
