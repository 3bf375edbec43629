"""Model benchmark: Hugging Face transformers' Mamba-2 models on mamba2-cutile against
transformers' own PyTorch path and against what transformers resolved itself (mamba_ssm's
Triton kernels when it is importable).

Models are built from configs with a fixed seed (no downloads): a 130M-class
`Mamba2ForCausalLM` (the mamba2-130m shape: hidden 768, 24 layers, 24 heads of 64, state 128,
1 group, vocab 50288) and a hybrid `BambaForCausalLM` (hidden 1024, 8 layers of which 2 are
attention, 32 Mamba heads of 64, state 128). Measured, in bf16 weights:

    train     forward + loss + backward of a (batch, seqlen) step: tokens / s
    prefill   the prompt's forward with a cache (logits of the last token): tokens / s,
              at batch 1 and 64
    decode    one generated token per row with the cache, greedy: ms per step, at batch 1 and 64

Implementations (`describe()` of the integration says what each of the five functions ran; it
is stored in every row):

    mamba2_cutile   `integrations.transformers.enable()`
    torch           transformers' PyTorch definitions (`torch_path()`), whatever was resolved
    transformers    the functions transformers resolved at import (mamba_ssm / causal_conv1d
                    when importable; skipped when that is the PyTorch path again). If the fused
                    training function fails (mamba_ssm without causal-conv1d's CUDA extension),
                    training is measured again with the unfused path ("transformers-unfused").

    python -m mamba2_cutile.bench.model --out DIR [--models mamba2-130m,bamba-hybrid]
        [--impls mamba2_cutile,torch,transformers] [--train-batch 8 --train-seqlen 2048]
        [--prompt 512] [--decode-steps 32] [--reps 5]

writes DIR/model.jsonl (one row per model, impl and measurement) and prints a table.
The config builders here are also the test models of tests/integrations and scripts/hf_compare.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time

import torch

# --------------------------------------------------------------------------------------------
# models from configs
# --------------------------------------------------------------------------------------------


def small_mamba2_config(**overrides):
    """The integration's test model: hidden 512, 4 layers, 16 heads of 64, state 128,
    2 groups (intermediate 1024), conv 4, vocab 256."""
    from transformers import Mamba2Config
    kw = dict(vocab_size=256, hidden_size=512, num_hidden_layers=4, num_heads=16, head_dim=64,
              state_size=128, n_groups=2, expand=2, conv_kernel=4, chunk_size=256,
              tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    return Mamba2Config(**kw)


def mamba2_130m_config(**overrides):
    """The mamba2-130m shape (hidden 768, 24 layers, 24 heads of 64, state 128, 1 group)."""
    from transformers import Mamba2Config
    kw = dict(vocab_size=50288, hidden_size=768, num_hidden_layers=24, num_heads=24,
              head_dim=64, state_size=128, n_groups=1, expand=2, conv_kernel=4, chunk_size=256,
              tie_word_embeddings=True, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    kw.update(overrides)
    return Mamba2Config(**kw)


def small_bamba_config(**overrides):
    """A small hybrid: 4 layers (layer 1 attention), hidden 256, 8 Mamba heads of 64,
    state 64, 2 groups, 4 attention heads (2 kv), vocab 256."""
    from transformers import BambaConfig
    kw = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1],
              mamba_n_heads=8, mamba_d_head=64, mamba_n_groups=2, mamba_d_state=64,
              mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256, max_position_embeddings=4096,
              tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    return BambaConfig(**kw)


def bamba_hybrid_config(**overrides):
    """The benchmark's hybrid: Bamba, hidden 1024, 8 layers (3 and 7 attention), 32 Mamba
    heads of 64, state 128, 1 group, 16 attention heads (8 kv), MLP 2816, vocab 32000."""
    from transformers import BambaConfig
    kw = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
              num_attention_heads=16, num_key_value_heads=8, attn_layer_indices=[3, 7],
              mamba_n_heads=32, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128,
              mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256,
              max_position_embeddings=65536, tie_word_embeddings=False, pad_token_id=0,
              bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    return BambaConfig(**kw)


def build_model(config, seed=0, dtype=torch.float32, device="cpu"):
    """A causal LM for `config` (Mamba2Config -> Mamba2ForCausalLM, BambaConfig ->
    BambaForCausalLM, ...) with weights from `seed`, in `dtype` on `device`, eval mode."""
    import transformers
    name = type(config).__name__.removesuffix("Config") + "ForCausalLM"
    cls = getattr(transformers, name)
    torch.manual_seed(seed)
    model = cls(config)
    return model.to(device=device, dtype=dtype).eval()


MODELS = {"mamba2-130m": mamba2_130m_config, "bamba-hybrid": bamba_hybrid_config}

# --------------------------------------------------------------------------------------------
# implementations
# --------------------------------------------------------------------------------------------

IMPLS = ("mamba2_cutile", "torch", "transformers")


@contextlib.contextmanager
def implementation(impl, fused=True):
    """Run the block with `impl`'s bindings of the five functions (module docstring)."""
    from ..integrations import transformers as it
    if impl == "mamba2_cutile":
        with it.enabled():
            yield
    elif impl == "torch":
        with it.torch_path():
            yield
    elif impl == "transformers":
        if fused:
            yield
        else:
            with unfused_training():
                yield
    else:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


@contextlib.contextmanager
def unfused_training():
    """Bind every loaded family's fused training function to one returning None (the mixer
    then runs its unfused path with the other four functions as they are)."""
    import sys
    from ..integrations import transformers as it
    saved = {}
    for m in it.MODULES:
        module = sys.modules.get(m)
        if module is not None:
            saved[m] = module.mamba2_split_conv1d_scan_combined
            module.mamba2_split_conv1d_scan_combined = it._unfused
    try:
        yield
    finally:
        for m, fn in saved.items():
            sys.modules[m].mamba2_split_conv1d_scan_combined = fn


def bindings(model, impl):
    """{name: implementation} of the model's family module under `impl`."""
    from ..integrations import transformers as it
    with implementation(impl):
        return it.describe(type(model).__module__)


# --------------------------------------------------------------------------------------------
# measurements
# --------------------------------------------------------------------------------------------


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn, reps, warmup=1):
    """Median wall seconds of fn() over reps (after warmup calls: compiles, autotuning),
    device-synchronized."""
    for _ in range(warmup):
        fn()
    _sync()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _empty_cache():
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _ids(model, batch, seqlen, seed=1):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (batch, seqlen), generator=gen)
    return ids.to(next(model.parameters()).device)


def measure_train(model, batch, seqlen, reps):
    """tokens / s of forward + loss + backward."""
    ids = _ids(model, batch, seqlen)
    model.train()

    def step():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    try:
        sec = _timed(step, reps)
    finally:
        model.zero_grad(set_to_none=True)
        model.eval()
    return {"tokens_per_s": batch * seqlen / sec, "ms": sec * 1e3}


def _greedy(model, ids, new_tokens):
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                          max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                          pad_token_id=0, eos_token_id=None, use_cache=True)


def measure_generation(model, batch, prompt, decode_steps, reps):
    """Prefill tokens / s (generate 1 token) and decode ms per token ((generate 1 + steps) -
    prefill, over steps), greedy, with the cache."""
    ids = _ids(model, batch, prompt)
    with torch.no_grad():
        pre = _timed(lambda: _greedy(model, ids, 1), reps)
        full = _timed(lambda: _greedy(model, ids, 1 + decode_steps), reps)
    return {"prefill_tokens_per_s": batch * prompt / pre, "prefill_ms": pre * 1e3,
            "decode_ms_per_token": max(full - pre, 0.0) / decode_steps * 1e3}


def _error(e):
    return f"error: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def bench_model(name, impls=IMPLS, train_batch=8, train_seqlen=2048, prompt=512,
                decode_steps=32, batches=(1, 64), reps=5, dtype=torch.bfloat16, emit=None,
                config=None, device="cuda"):
    """Rows (dicts) for one model of MODELS (or `config`, labelled `name`); `emit(row)` is
    called as each row is ready."""
    from ..integrations import transformers as it
    model = build_model(config if config is not None else MODELS[name](), dtype=dtype,
                        device=device)
    rows = []

    def add(row):
        rows.append(row)
        if emit:
            emit(row)
    resolved = it.describe(type(model).__module__)
    for impl in impls:
        if impl == "transformers" and all(v == "transformers (PyTorch)" for v in resolved.values()):
            add(dict(model=name, impl=impl, measurement="all", bindings=resolved,
                     status="skipped (transformers resolved its PyTorch path: same as torch)"))
            continue
        base = dict(model=name, impl=impl, dtype=str(dtype).removeprefix("torch."))
        for fused in (True, False):
            label = impl if fused else impl + "-unfused"
            try:
                with implementation(impl, fused=fused):
                    b = it.describe(type(model).__module__)
                    r = measure_train(model, train_batch, train_seqlen, reps)
                add(dict(base, impl=label, measurement="train", batch=train_batch,
                         seqlen=train_seqlen, bindings=b, status="ok", **r))
                break
            except Exception as e:  # noqa: BLE001 - recorded in the row
                add(dict(base, impl=label, measurement="train", batch=train_batch,
                         seqlen=train_seqlen, status=_error(e)))
                _empty_cache()
                if impl != "transformers":
                    break
        for batch in batches:
            try:
                with implementation(impl):
                    b = it.describe(type(model).__module__)
                    r = measure_generation(model, batch, prompt, decode_steps, reps)
                add(dict(base, measurement="generate", batch=batch, prompt=prompt,
                         decode_steps=decode_steps, bindings=b, status="ok", **r))
            except Exception as e:  # noqa: BLE001
                add(dict(base, measurement="generate", batch=batch, prompt=prompt,
                         status=_error(e)))
                _empty_cache()
    del model
    _empty_cache()
    return rows


def format_table(rows):
    """A plain-text table of the rows, with speedups of mamba2_cutile over the others."""
    lines = [f"{'model':<14}{'impl':<22}{'measure':<10}{'batch':>6}  {'result':<44}{'status'}"]
    ours = {}
    for r in rows:
        if r["impl"] == "mamba2_cutile" and r.get("status") == "ok":
            ours[(r["model"], r["measurement"], r.get("batch"))] = r
    for r in rows:
        if r.get("status") != "ok":
            res = ""
        elif r["measurement"] == "train":
            res = f"{r['tokens_per_s']:,.0f} tok/s"
        else:
            res = (f"prefill {r['prefill_tokens_per_s']:,.0f} tok/s, "
                   f"decode {r['decode_ms_per_token']:.2f} ms/tok")
        o = ours.get((r["model"], r["measurement"], r.get("batch")))
        if o is not None and r is not o and res:
            if r["measurement"] == "train":
                res += f" (ours {o['tokens_per_s'] / r['tokens_per_s']:.2f}x)"
            else:
                res += (f" (ours {o['prefill_tokens_per_s'] / r['prefill_tokens_per_s']:.2f}x"
                        f", {r['decode_ms_per_token'] / max(o['decode_ms_per_token'], 1e-9):.2f}x)")
        lines.append(f"{r['model']:<14}{r['impl']:<22}{r['measurement']:<10}"
                     f"{str(r.get('batch', '')):>6}  {res:<44}{r.get('status', '')}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m mamba2_cutile.bench.model",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for model.jsonl")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--train-batch", type=int, default=8)
    ap.add_argument("--train-seqlen", type=int, default=2048)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the model benchmark needs a CUDA GPU")
    impls = [s for s in args.impls.split(",") if s]
    for s in impls:
        if s not in IMPLS:
            raise SystemExit(f"--impls: unknown {s!r}, choose from {', '.join(IMPLS)}")
    models = [s for s in args.models.split(",") if s]
    for s in models:
        if s not in MODELS:
            raise SystemExit(f"--models: unknown {s!r}, choose from {', '.join(MODELS)}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "model.jsonl")
    import transformers
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                transformers=transformers.__version__)
    rows = []
    with open(path, "a") as f:
        def emit(row):
            row = dict(row, **meta)
            f.write(json.dumps(row) + "\n")
            f.flush()
            print(json.dumps(row), flush=True)
        for name in models:
            rows += bench_model(name, impls, args.train_batch, args.train_seqlen, args.prompt,
                                args.decode_steps, tuple(int(b) for b in args.batches.split(",")),
                                args.reps, emit=emit)
    print(format_table(rows))
    print(f"rows appended to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
