"""Helpers of the transformers integration tests (CPU and GPU): a training step's logits, loss
and parameter gradients, teacher-forced generation, packed batches."""

import torch

from mamba2_cutile.bench.accuracy import rel_err


#: the families other than mamba2 and bamba (bench.model builds those), falcon_h1 with and
#: without its gated norm
OTHER_FAMILIES = ("falcon_h1", "falcon_h1_norm", "granitemoehybrid", "nemotron_h", "zamba2")


def family_config(family):
    """Tiny configs (hidden 64, 4 Mamba heads of 32, state 16, 2 groups, chunk 64) of the
    other four families, one Mamba layer and one attention layer each."""
    import transformers as T
    common = dict(vocab_size=128, hidden_size=64, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2, tie_word_embeddings=False)
    if family.startswith("falcon_h1"):
        return T.FalconH1Config(**common, num_hidden_layers=2, num_attention_heads=2,
                                num_key_value_heads=1, head_dim=32, intermediate_size=128,
                                mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=2,
                                mamba_d_state=16, mamba_chunk_size=64, mamba_d_ssm=128,
                                mamba_rms_norm=family.endswith("norm"))
    if family == "granitemoehybrid":
        config = T.GraniteMoeHybridConfig(**common, num_hidden_layers=2, num_attention_heads=2,
                                          num_key_value_heads=1, intermediate_size=128,
                                          layer_types=["mamba", "attention"], mamba_n_heads=4,
                                          mamba_d_head=32, mamba_n_groups=2, mamba_d_state=16,
                                          mamba_chunk_size=64, num_local_experts=2,
                                          num_experts_per_tok=1)
        # the experts' loop, not torch._grouped_mm, which refuses float64 (the reference)
        config._experts_implementation = "eager"
        return config
    if family == "nemotron_h":
        return T.NemotronHConfig(**common, layers_block_type=["mamba", "attention", "mlp"],
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                 intermediate_size=128, mamba_num_heads=4, mamba_head_dim=32,
                                 n_groups=2, ssm_state_size=16, chunk_size=64)
    return T.Zamba2Config(**common, num_hidden_layers=2, layers_block_type=["mamba", "hybrid"],
                          num_attention_heads=2, num_key_value_heads=2, attention_head_dim=64,
                          intermediate_size=128, mamba_headdim=32, mamba_ngroups=2,
                          mamba_d_state=16, chunk_size=64, n_mamba_heads=4, use_mem_rope=False)



def train_step(model, ids, **kwargs):
    """(logits, loss, {parameter: grad}) of forward + loss + backward in training mode."""
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, use_cache=False, **kwargs)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    model.eval()
    return out.logits.detach(), out.loss.detach(), grads


def grad_errors(ours, ref):
    """{parameter: rel_err} over the union of both gradient dicts (a gradient on one side only
    is an error of inf)."""
    errs = {}
    for n in set(ours) | set(ref):
        if n not in ours or n not in ref:
            errs[n] = float("inf")
        else:
            errs[n] = rel_err(ours[n], ref[n])
    return errs


def forward_logits(model, ids, **kwargs):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False, **kwargs).logits.float()


def greedy_generate(model, ids, new_tokens):
    """(generated ids (b, prompt + new), per-step logits (b, new, vocab)) with the cache."""
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0, eos_token_id=None, use_cache=True,
                             output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits, dim=1).float()


def teacher_forced_logits(model, sequences, prompt_len):
    """The logits that predict tokens prompt_len.. of `sequences`, from one full forward
    without a cache: what each decode step should have produced on the same ids."""
    logits = forward_logits(model, sequences[:, :-1])
    return logits[:, prompt_len - 1:]


def known_decode_bug(model):
    """Whether the installed transformers' own PyTorch decode path is known to disagree with its
    full forward for this model: transformers < 5.18's FalconH1 with its gated norm
    (`mamba_rms_norm=True`) reshapes a decode step's (batch, dim) input wrongly."""
    import transformers
    version = tuple(int(v) for v in transformers.__version__.split(".")[:2])
    return (type(model).__name__.startswith("FalconH1") and
            bool(getattr(model.config, "mamba_rms_norm", False)) and version < (5, 18))


def check_against_torch_decode(model, ours_steps, seq, prompt_len, ref_steps, tol, torch_path):
    """For a model with `known_decode_bug`: asserts our per-step logits equal those of
    transformers' PyTorch path generating with the cache from the same prompt (`torch_path`:
    the integration's context manager), over the steps before the first position where the two
    greedy continuations differ (after it their contexts differ), and that this path disagrees
    with its own full forward `ref_steps`; returns the reason to mark the comparison with the
    full forward an expected failure."""
    import transformers
    assert known_decode_bug(model)
    with torch.no_grad(), torch_path():
        torch_seq, torch_steps = greedy_generate(model, seq[:, :prompt_len], ours_steps.shape[1])
    same = (torch_seq[:, prompt_len:] == seq[:, prompt_len:].to(torch_seq.device)).cpu()
    # step k's logits depend on the ids before k: compare up to the first differing id
    first_diff = [int(row.logical_not().nonzero()[0]) if not row.all() else row.numel()
                  for row in same]
    n = min(first_diff) + 1 if min(first_diff) < same.shape[1] else same.shape[1]
    ours_vs_torch = rel_err(ours_steps[:, :n], torch_steps[:, :n])
    assert ours_vs_torch <= tol, f"ours vs transformers' own decode path: {ours_vs_torch:.3e}"
    own = rel_err(torch_steps[:, :n].to(ref_steps.dtype), ref_steps[:, :n])
    assert own > tol, "transformers' decode path agrees with its full forward: no known bug"
    return (f"transformers {transformers.__version__}'s own PyTorch decode path disagrees with "
            f"its full forward ({own:.3e}); ours equals its decode path ({ours_vs_torch:.1e} "
            f"over {n} steps)")


def greedy_agreement(ids_a, ids_b, ref_logits, tol):
    """(positions compared, positions that differ) between two greedy continuations, over
    the steps whose reference top-2 logit margin exceeds `tol` (random weights give near-ties),
    up to the first disagreement (after it the contexts differ)."""
    top2 = ref_logits.topk(2, dim=-1).values
    margin = top2[..., 0] - top2[..., 1]
    compared = differ = 0
    for row in range(ids_a.shape[0]):
        for step in range(ids_a.shape[1]):
            if ids_a[row, step] != ids_b[row, step]:
                if margin[row, step] > tol:
                    differ += 1
                break
            if margin[row, step] > tol:
                compared += 1
    return compared, differ


def packed(seqs):
    """One packed row of the sequences (each (1, len)): ids (1, total), seq_idx (1, total)
    int32, cu_seq_lens (s + 1,) int32, position_ids (1, total)."""
    ids = torch.cat(seqs, dim=1)
    lens = [s.shape[1] for s in seqs]
    seq_idx = torch.cat([torch.full((1, n), i, dtype=torch.int32) for i, n in enumerate(lens)], 1)
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    dev = seqs[0].device
    return ids, seq_idx.to(dev), cu.to(dev), pos.to(dev)
