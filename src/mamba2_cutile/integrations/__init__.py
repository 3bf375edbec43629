"""Integrations of mamba2-cutile into model libraries.

`integrations.transformers`: Hugging Face transformers' Mamba-2 model families (mamba2, bamba,
falcon_h1, granitemoehybrid, nemotron_h, zamba2) on mamba2-cutile's kernels with one call,
`enable()`. Importing this package imports neither transformers nor the integration.
"""
