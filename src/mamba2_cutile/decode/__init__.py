"""Mamba-2 decode: `selective_state_update`, the token-by-token state update, in place."""

from .api import selective_state_update
from .plan import DecodeConfig, decode_config, decode_plan

__all__ = ["selective_state_update", "DecodeConfig", "decode_config", "decode_plan"]
