"""The model benchmark's rows and table on the CPU with a tiny model (the timings mean nothing
here; the GPU run is `python -m mamba2_cutile.bench.model --out DIR`)."""

import pytest
import torch

pytest.importorskip("transformers")

from mamba2_cutile.bench import model as bm  # noqa: E402


def test_bench_rows_and_table_on_a_tiny_model():
    config = bm.small_mamba2_config(hidden_size=64, num_hidden_layers=1, num_heads=2,
                                    state_size=16, n_groups=1, chunk_size=64)
    rows = []
    bm.bench_model("tiny", ("mamba2_cutile", "torch", "transformers"), train_batch=1,
                   train_seqlen=40, prompt=8, decode_steps=2, batches=(1,), reps=1,
                   dtype=torch.float32, emit=rows.append, config=config, device="cpu")
    by = {(r["impl"], r["measurement"]): r for r in rows}
    for impl in ("mamba2_cutile", "torch"):
        assert by[(impl, "train")]["status"] == "ok" and by[(impl, "train")]["tokens_per_s"] > 0
        gen = by[(impl, "generate")]
        assert gen["status"] == "ok" and gen["prefill_tokens_per_s"] > 0
        assert gen["decode_ms_per_token"] >= 0
    assert set(by[("mamba2_cutile", "train")]["bindings"].values()) == {"mamba2_cutile"}
    assert set(by[("torch", "generate")]["bindings"].values()) == {"transformers (PyTorch)"}
    # without mamba_ssm transformers resolved its PyTorch path: the third impl is skipped
    assert by[("transformers", "all")]["status"].startswith("skipped")
    table = bm.format_table(rows)
    assert "mamba2_cutile" in table and "tok/s" in table and "(ours" in table


def test_bench_rejects_unknown_names():
    with pytest.raises(ValueError, match="impl must be one of"):
        with bm.implementation("triton"):
            pass
    with pytest.raises(SystemExit, match="--models: unknown|needs a CUDA GPU"):
        bm.main(["--out", "/tmp/unused", "--models", "nope"])
