"""Compare transformers' Mamba-2 models on mamba2-cutile against transformers' PyTorch path
run in a separate process, on the GPU, in float32.

    python scripts/hf_compare.py [--models mamba2,bamba] [--seqlen 600] [--batch 2]
        [--prompt 333] [--new-tokens 64] [--json FILE]

Models: mamba2 and bamba are the test models (bench.model.small_mamba2_config: hidden 512,
4 layers, 16 heads of 64, state 128, 2 groups; small_bamba_config), mamba2-130m and
bamba-hybrid the benchmark's. Per model (built from a config with a fixed seed; the weights go
to the child process through a state-dict file, so both sides hold identical tensors):

1. training step (train mode, labels = input ids): logits, loss and every parameter gradient;
2. generation: 64 greedy tokens with the cache on our kernels; teacher forcing: the PyTorch
   path's full forward on the same ids gives the logits each step should have produced;
   greedy ids compared with the PyTorch path's own generation wherever the top-2 margin of
   its logits exceeds the tolerance (random weights give near-ties);
3. the same training step and teacher-forced logits from the PyTorch path in float64, so that
   both float32 paths get an error against a float64 definition.

The PyTorch path runs in a child process without the PYTHONPATH entries that hold mamba_ssm or
causal_conv1d (the GPU kit puts the baseline mamba_ssm on it: in-process, transformers would
import it and run its Triton kernels, and its fused function fails without causal-conv1d's CUDA
extension), with `mamba_ssm` and
`causal_conv1d` made unimportable there as well, so transformers resolves its PyTorch
fallbacks. Each side reports what its five functions ran (`integrations.transformers.describe`)
and the script fails if the child did not run transformers' PyTorch definitions everywhere.

Tolerances, max|a - b| / max|b|: logits, loss and teacher-forced logits 5e-3, gradients 1e-2
(ours vs the PyTorch path in float32; the float64 errors are printed for both, see
tests/integrations/test_hf_integration_gpu.py for the derivation). Exit status 1 on a miss.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

LOGITS_TOL, GRAD_TOL, GEN_TOL = 5e-3, 1e-2, 5e-3
BLOCKED = ("mamba_ssm", "causal_conv1d", "selective_scan_cuda", "causal_conv1d_cuda")


def _block_baselines():
    """Make the baseline packages unimportable in this process: a None entry in sys.modules
    makes `import` raise ImportError and `importlib.util.find_spec` return None."""
    for name in BLOCKED:
        if sys.modules.get(name) is None:
            sys.modules[name] = None


def _configs():
    from mamba2_cutile.bench.model import (bamba_hybrid_config, mamba2_130m_config,
                                           small_bamba_config, small_mamba2_config)
    return {"mamba2": small_mamba2_config, "bamba": small_bamba_config,
            "mamba2-130m": mamba2_130m_config, "bamba-hybrid": bamba_hybrid_config}


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _train_step(model, ids):
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters()
             if p.grad is not None}
    model.zero_grad(set_to_none=True)
    model.eval()
    return {"logits": out.logits.detach().float().cpu(), "loss": out.loss.detach().float().cpu(),
            "grads": grads}


def _generate(model, prompt, new_tokens):
    with torch.no_grad():
        out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0, eos_token_id=None, use_cache=True,
                             output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits, dim=1).float().cpu()


def _teacher_forced(model, sequences, prompt_len):
    with torch.no_grad():
        logits = model(input_ids=sequences[:, :-1], use_cache=False).logits.float()
    return logits[:, prompt_len - 1:].cpu()


def _build(family, dtype, device, state_path=None):
    from mamba2_cutile.bench.model import build_model
    model = build_model(_configs()[family](), dtype=torch.float32, device=device)
    if state_path is not None:
        model.load_state_dict(torch.load(state_path, map_location=device))
    return model.to(dtype)


def _env_without_baselines():
    """(the environment for the child, the PYTHONPATH entries taken out): every entry that holds
    a `mamba_ssm` or `causal_conv1d` package goes, with whatever else it holds (the GPU kit keeps
    the baselines in a directory of their own); the rest (this library's source, cuTile) stays.
    The child also blocks both imports (`_block_baselines`)."""
    env = dict(os.environ)
    keep, removed = [], []
    for entry in filter(None, env.get("PYTHONPATH", "").split(os.pathsep)):
        holds = any(os.path.isdir(os.path.join(entry, pkg))
                    for pkg in ("mamba_ssm", "causal_conv1d"))
        (removed if holds else keep).append(entry)
    if keep:
        env["PYTHONPATH"] = os.pathsep.join(keep)
    else:
        env.pop("PYTHONPATH", None)
    return env, removed


def child(work):
    """The PyTorch path: transformers without mamba_ssm / causal-conv1d."""
    _block_baselines()
    from mamba2_cutile.integrations import transformers as it
    job = torch.load(os.path.join(work, "job.pt"))
    results = {}
    for family in job["families"]:
        model = _build(family, torch.float32, job["device"],
                       os.path.join(work, f"{family}.state.pt"))
        bindings = it.describe(type(model).__module__)
        ids = job[family]["ids"].to(job["device"])
        seq = job[family]["sequences"].to(job["device"])
        prompt_len = job[family]["prompt_len"]
        r = {"bindings": bindings, "mamba_ssm_imported": sys.modules.get("mamba_ssm") is not None,
             "train32": _train_step(model, ids),
             "teacher32": _teacher_forced(model, seq, prompt_len)}
        r["gen_sequences"], r["gen_logits"] = _generate(model, seq[:, :prompt_len],
                                                        seq.shape[1] - prompt_len)
        r["gen_sequences"] = r["gen_sequences"].cpu()
        model = model.double()
        r["train64"] = _train_step(model, ids)
        r["teacher64"] = _teacher_forced(model, seq, prompt_len)
        results[family] = r
        del model
    torch.save(results, os.path.join(work, "torch_path.pt"))


def _greedy_agreement(ours, ref, ref_logits, tol):
    top2 = ref_logits.topk(2, dim=-1).values
    margin = top2[..., 0] - top2[..., 1]
    compared = differ = 0
    for row in range(ours.shape[0]):
        for step in range(ours.shape[1]):
            if ours[row, step] != ref[row, step]:
                differ += int(margin[row, step] > tol)
                break
            compared += int(margin[row, step] > tol)
    return compared, differ


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="mamba2,bamba")
    ap.add_argument("--seqlen", type=int, default=600)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=333)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--json", help="write the summary here")
    ap.add_argument("--device", default="cuda", help="cuda (the comparison); cpu: a dry run "
                    "of the script on the library's CPU paths")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args.child)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("hf_compare needs a CUDA GPU (or --device cpu for a dry run)")
    from mamba2_cutile.integrations import transformers as it
    families = [f for f in args.models.split(",") if f]
    for f in families:
        if f not in _configs():
            raise SystemExit(f"--models: unknown {f!r}, choose from {', '.join(_configs())}")
    summary, ok = {}, True
    with tempfile.TemporaryDirectory(prefix="hf_compare_") as work:
        job, ours = {"families": families, "device": args.device}, {}
        it.enable()
        for family in families:
            model = _build(family, torch.float32, args.device)
            torch.save(model.state_dict(), os.path.join(work, f"{family}.state.pt"))
            g = torch.Generator().manual_seed(1)
            ids = torch.randint(3, model.config.vocab_size, (args.batch, args.seqlen),
                                generator=g).to(args.device)
            prompt = torch.randint(3, model.config.vocab_size, (args.batch, args.prompt),
                                   generator=g).to(args.device)
            r = {"bindings": it.describe(type(model).__module__), "train": _train_step(model, ids)}
            seq, r["gen_logits"] = _generate(model, prompt, args.new_tokens)
            r["sequences"] = seq.cpu()
            ours[family] = r
            job[family] = {"ids": ids.cpu(), "sequences": seq.cpu(), "prompt_len": args.prompt}
            del model
        it.disable()
        torch.save(job, os.path.join(work, "job.pt"))
        env, removed = _env_without_baselines()
        cmd = [sys.executable, os.path.abspath(__file__), "--child", work]
        print(f"PyTorch path: {' '.join(cmd)} (PYTHONPATH entries removed: {removed!r})",
              flush=True)
        subprocess.run(cmd, env=env, check=True)
        ref = torch.load(os.path.join(work, "torch_path.pt"))
    for family in families:
        o, t = ours[family], ref[family]
        torch_ok = all(v == "transformers (PyTorch)" for v in t["bindings"].values()) and \
            not t["mamba_ssm_imported"]
        ours_ok = all(v.startswith("mamba2_cutile") for v in o["bindings"].values())
        grads32 = {n: _rel(o["train"]["grads"][n], t["train32"]["grads"][n])
                   for n in t["train32"]["grads"]}
        grads64 = {n: _rel(o["train"]["grads"][n], t["train64"]["grads"][n])
                   for n in t["train64"]["grads"]}
        torch_grads64 = {n: _rel(t["train32"]["grads"][n], t["train64"]["grads"][n])
                         for n in t["train64"]["grads"]}
        worst = max(grads32, key=grads32.get)
        tol_abs = GEN_TOL * t["teacher32"].abs().max().item()
        compared, differ = _greedy_agreement(o["sequences"][:, args.prompt:],
                                             t["gen_sequences"][:, args.prompt:],
                                             t["teacher32"], tol_abs)
        s = {
            "ours_ran": o["bindings"], "torch_path_ran": t["bindings"],
            "torch_process_imported_mamba_ssm": t["mamba_ssm_imported"],
            "logits_vs_torch32": _rel(o["train"]["logits"], t["train32"]["logits"]),
            "loss_vs_torch32": _rel(o["train"]["loss"], t["train32"]["loss"]),
            "worst_grad_vs_torch32": [worst, grads32[worst]],
            "grads_missing": sorted(set(t["train32"]["grads"]) ^ set(o["train"]["grads"])),
            "logits_vs_torch64": _rel(o["train"]["logits"], t["train64"]["logits"]),
            "torch32_logits_vs_torch64": _rel(t["train32"]["logits"], t["train64"]["logits"]),
            "worst_grad_vs_torch64": max(grads64.values()),
            "torch32_worst_grad_vs_torch64": max(torch_grads64.values()),
            "teacher_forced_vs_torch32": _rel(o["gen_logits"], t["teacher32"]),
            "teacher_forced_vs_torch64": _rel(o["gen_logits"], t["teacher64"]),
            "torch32_generation_vs_torch64_teacher": _rel(t["gen_logits"], t["teacher64"]),
            "greedy_compared": compared, "greedy_differ": differ,
        }
        checks = {
            "the child ran transformers' PyTorch path": torch_ok,
            "ours ran mamba2_cutile": ours_ok,
            "logits": s["logits_vs_torch32"] <= LOGITS_TOL,
            "loss": s["loss_vs_torch32"] <= LOGITS_TOL,
            "every gradient": grads32[worst] <= GRAD_TOL and not s["grads_missing"],
            "teacher-forced logits": s["teacher_forced_vs_torch32"] <= GEN_TOL,
            "greedy ids": compared > 0 and differ == 0,
        }
        s["failed"] = [k for k, v in checks.items() if not v]
        ok &= not s["failed"]
        summary[family] = s
        print(f"\n== {family}\nours ran:       {o['bindings']}\nPyTorch path:   {t['bindings']}"
              f" (mamba_ssm imported there: {t['mamba_ssm_imported']})")
        for k, v in s.items():
            if k not in ("ours_ran", "torch_path_ran"):
                print(f"  {k:<40} {v if not isinstance(v, float) else f'{v:.3e}'}")
        result = "ok" if not s["failed"] else "FAILED: " + ", ".join(s["failed"])
        print(f"  {'result':<40} {result}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main() or 0)
