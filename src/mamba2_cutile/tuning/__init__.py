"""The tuning cache (runtime side): lookup of tuned ForwardConfig overrides per shape bucket,
and the table shipped for the H200. The search lives in `mamba2_cutile.bench.tune`."""

from .cache import (ENV_DIR, ENV_DISABLE, FORWARD, SHIPPED, TuningKey, apply_forward,
                    bucket_bh, bucket_seqlen, cache_dir, cache_path, entries, lookup, make_key,
                    pad_dim, reload, store, valid_overrides)

__all__ = ["ENV_DIR", "ENV_DISABLE", "FORWARD", "SHIPPED", "TuningKey", "apply_forward",
           "bucket_bh", "bucket_seqlen", "cache_dir", "cache_path", "entries", "lookup",
           "make_key", "pad_dim", "reload", "store", "valid_overrides"]
