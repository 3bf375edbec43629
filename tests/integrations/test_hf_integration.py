"""transformers integration on the CPU: enable()/disable() patch and restore every family, the
import hook, the clear errors, and models on our CPU path against transformers' PyTorch path
(logits, loss, every parameter gradient, generation, packed batches, torch.compile).

Models are built from configs with a fixed seed (no network). Tolerance: max|ours - torch| /
max|torch| <= 1e-4 in float32 (the issue's bound); the errors measured here are 1e-6 (logits)
to 3e-5 (gradients) -- two different float32 evaluations of the same chunked math.
"""

import importlib
import sys
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_support import (OTHER_FAMILIES, check_against_torch_decode,  # noqa: E402
                        family_config, forward_logits, grad_errors, greedy_agreement,
                        greedy_generate, known_decode_bug, packed, teacher_forced_logits,
                        train_step)

from mamba2_cutile.bench.accuracy import rel_err  # noqa: E402
from mamba2_cutile.bench.model import (build_model, small_bamba_config,  # noqa: E402
                                       small_mamba2_config)
from mamba2_cutile.integrations import transformers as it  # noqa: E402

TOL = 1e-4
#: test shapes: 100 and 77 tokens, not multiples of the chunk (64) nor of the conv width
SEQLEN = 100


@pytest.fixture(autouse=True)
def _always_disabled():
    it.disable()
    yield
    it.disable()


def _installed_modules():
    mods = []
    for m in it.MODULES:
        if importlib.util.find_spec(m) is not None:
            mods.append(importlib.import_module(m))
    return mods


# ------------------------------------------------------------------------ patch and restore

def test_enable_patches_every_family_and_disable_restores():
    mods = _installed_modules()
    assert [m.__name__ for m in mods] == list(it.MODULES), "all six families ship with 5.x"
    before = {m.__name__: {n: m.__dict__[n] for n in it.NAMES} for m in mods}
    patched = it.enable()
    assert sorted(patched) == sorted(before)
    for m in mods:
        assert set(it.describe(m.__name__).values()) == {"mamba2_cutile"}, m.__name__
        assert it.status()[m.__name__] == "patched"
    it.disable()
    for m in mods:
        for n in it.NAMES:
            assert m.__dict__[n] is before[m.__name__][n], (m.__name__, n)
    assert not it.is_enabled()


def test_enable_and_disable_inside_torch_path_hold_after_it():
    """Inside torch_path() the block runs transformers' PyTorch path whatever enable() or
    disable() do there; after it their state holds: enabled with the adapters, or disabled
    with exactly the objects transformers had bound."""
    mod = importlib.import_module(it.MODULES[0])
    before = {n: mod.__dict__[n] for n in it.NAMES}
    with it.torch_path():
        it.enable()
        assert set(it.describe(mod.__name__).values()) == {"transformers (PyTorch)"}
    try:
        assert it.is_enabled() and set(it.describe(mod.__name__).values()) == {"mamba2_cutile"}
        with it.torch_path():
            it.disable()
            assert set(it.describe(mod.__name__).values()) == {"transformers (PyTorch)"}
        assert not it.is_enabled() and it.status()[mod.__name__] == "not patched"
        assert all(mod.__dict__[n] is before[n] for n in it.NAMES)
    finally:
        it.disable()
    assert all(mod.__dict__[n] is before[n] for n in it.NAMES)


def test_context_manager_and_unfused_switch():
    mod = importlib.import_module(it.MODULES[0])
    original = mod.mamba2_split_conv1d_scan_combined
    # transformers 5.17's Mamba-2 norm normalises all of dim at once: its own fused adapter
    fused = (it.whole_norm_split_conv1d_scan_combined if it._norm_is_whole(mod)
             else it.mamba2_split_conv1d_scan_combined)
    with it.enabled():
        assert mod.mamba2_split_conv1d_scan_combined is fused
        with it.enabled(fused=False):
            assert it.describe(mod.__name__)["mamba2_split_conv1d_scan_combined"] == \
                "mamba2_cutile (unfused)"
        assert mod.mamba2_split_conv1d_scan_combined is fused
        with it.torch_path():
            assert set(it.describe(mod.__name__).values()) == {"transformers (PyTorch)"}
        assert it.is_enabled()
    assert mod.mamba2_split_conv1d_scan_combined is original
    assert not it.is_enabled()


def test_module_imported_after_enable_is_patched(monkeypatch):
    name = "transformers.models.zamba2.modeling_zamba2"
    parent = importlib.import_module("transformers.models.zamba2")
    importlib.import_module(name)
    monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(parent, "modeling_zamba2", sys.modules.get(name), raising=False)
    it.enable()
    assert it.status()[name] == "patched on import"
    fresh = importlib.import_module(name)
    assert set(it.describe(name).values()) == {"mamba2_cutile"}
    assert it.status()[name] == "patched"
    it.disable()
    assert set(it.describe(name).values()) == {"transformers (PyTorch)"}
    # transformers' own binding is back (from 5.25, with `kernels`, an nn.Module wrapping it)
    assert it._hub_function(fresh.mamba2_chunk_scan).__wrapped__.__module__ == name
    # after disable() the hook is gone: a new import is left as transformers made it
    monkeypatch.delitem(sys.modules, name)
    importlib.import_module(name)
    assert set(it.describe(name).values()) == {"transformers (PyTorch)"}


def test_module_missing_a_name_raises_and_patches_nothing(monkeypatch):
    mamba2 = importlib.import_module(it.MODULES[0])
    before = {n: mamba2.__dict__[n] for n in it.NAMES}
    fake = types.ModuleType(it.MODULES[-1])
    for n in it.NAMES[:-1]:
        setattr(fake, n, lambda *a, **k: None)
    monkeypatch.setitem(sys.modules, it.MODULES[-1], fake)
    with pytest.raises(it.IntegrationError, match=r"modeling_zamba2 does not define "
                                                  r"mamba2_chunk_scan \(of the five"):
        it.enable()
    assert {n: mamba2.__dict__[n] for n in it.NAMES} == before
    assert not it.is_enabled()


def test_unsupported_transformers_version(monkeypatch):
    # importing a modeling module can replace sys.modules["transformers"]: patch the live one
    live = sys.modules["transformers"]
    for version in ("4.57.1", "5.16.0", "6.0.0"):
        monkeypatch.setattr(live, "__version__", version)
        with pytest.raises(it.IntegrationError, match=rf"transformers {version} is not supported"):
            it.enable()
    monkeypatch.setattr(live, "__version__", "5.17.0")
    assert isinstance(it.enable(), list)


def test_describe_names_what_transformers_resolved():
    """A function transformers' decorator resolved against an importable package is reported
    by that package's function (here math.sqrt standing in for mamba_ssm's); its PyTorch
    fallback as transformers (PyTorch); torch_path() still finds the PyTorch definition."""
    from transformers.integrations import use_kernel_func_from_hub_with_fallback
    module = types.ModuleType("fake_modeling")

    def sqrt(x):
        return x ** 0.5
    sqrt.__module__ = module.__name__
    resolved = use_kernel_func_from_hub_with_fallback("sqrt", "math")(sqrt)
    fallback = use_kernel_func_from_hub_with_fallback("sqrt", "no_such_package_here")(sqrt)
    assert it._describe_obj(module, resolved) == "math.sqrt"
    assert it._describe_obj(module, fallback) == "transformers (PyTorch)"
    module.sqrt = resolved
    assert it._torch_definition(module, "sqrt") is sqrt


# ------------------------------------------------------------------------ adapter pieces

def test_packed_seq_idx_from_cu_seq_lens():
    cu = torch.tensor([0, 3, 3, 7, 9], dtype=torch.int32)
    want = torch.tensor([[0, 0, 0, 2, 2, 2, 2, 3, 3]], dtype=torch.int32)
    got = it.packed_seq_idx({"cu_seq_lens_q": cu}, 1, 9, "cpu")
    assert got.dtype == torch.int32 and torch.equal(got, want)
    # a conv input the cache prefixed with 3 tokens of context: they join the first sequence
    got = it.packed_seq_idx({"cu_seq_lens_q": cu}, 1, 12, "cpu")
    assert torch.equal(got, torch.cat([torch.zeros(1, 3, dtype=torch.int32), want], 1))
    assert torch.equal(it.packed_seq_idx({"cu_seqlens": cu}, 1, 9, "cpu"), want)
    # seq_idx wins over cu_seq_lens_q; shorter ones are padded on the left with the first id
    sid = torch.tensor([[4, 4, 5]])
    assert torch.equal(it.packed_seq_idx({"seq_idx": sid, "cu_seq_lens_q": cu}, 1, 5, "cpu"),
                       torch.tensor([[4, 4, 4, 4, 5]], dtype=torch.int32))
    assert it.packed_seq_idx({"position_ids": torch.arange(9)[None]}, 1, 9, "cpu") is None


def test_packed_seq_idx_errors():
    with pytest.raises(ValueError, match="seq_idx must have shape"):
        it.packed_seq_idx({"seq_idx": torch.zeros(1, 10, dtype=torch.int32)}, 1, 9, "cpu")
    with pytest.raises(TypeError, match="seq_idx must be a torch.Tensor"):
        it.packed_seq_idx({"seq_idx": [0, 0, 1]}, 1, 3, "cpu")
    with pytest.raises(ValueError, match="cu_seq_lens_q must be a 1-D tensor"):
        it.packed_seq_idx({"cu_seq_lens_q": torch.zeros(1, 3)}, 1, 3, "cpu")


def test_chunk_size_mapping():
    assert [it._scan_chunk(c) for c in (64, 128, 256, 32, 100, 192, 512)] == \
        [64, 128, 256, 64, 128, 128, 256]


# ------------------------------------------------------------------------ models

@pytest.fixture(scope="module")
def mamba2():
    return build_model(small_mamba2_config(chunk_size=64))


@pytest.fixture(scope="module")
def small_mamba2():
    """A smaller model for the packed gradient check: 2 layers, hidden 256, 8 heads of 64,
    state 64, 2 groups."""
    return build_model(small_mamba2_config(chunk_size=64, hidden_size=256, num_hidden_layers=2,
                                           num_heads=8, state_size=64))


def _ids(model, b, l, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.config.vocab_size, (b, l), generator=g)


def _check_training(model, ids, **kwargs):
    with it.torch_path():
        ref = train_step(model, ids, **kwargs)
    with it.enabled():
        ours = train_step(model, ids, **kwargs)
    e_logits, e_loss = rel_err(ours[0], ref[0]), rel_err(ours[1], ref[1])
    errs = grad_errors(ours[2], ref[2])
    worst = max(errs, key=errs.get)
    print(f"logits {e_logits:.2e} loss {e_loss:.2e} worst grad {worst} {errs[worst]:.2e}")
    assert len(ref[2]) == sum(1 for _ in model.parameters())
    assert e_logits <= TOL and e_loss <= TOL
    assert errs[worst] <= TOL, {k: v for k, v in errs.items() if v > TOL}


def test_mamba2_training_matches_torch_path(mamba2):
    _check_training(mamba2, _ids(mamba2, 2, SEQLEN))


def test_bamba_training_matches_torch_path():
    model = build_model(small_bamba_config(mamba_chunk_size=64))
    _check_training(model, _ids(model, 2, 77))


@pytest.mark.parametrize("family", OTHER_FAMILIES)
def test_other_families_match_torch_path(family):
    """Training step (logits, loss, every gradient) and 4 generated tokens' logits of each
    other family on our CPU path against transformers' PyTorch path (falcon_h1 with and
    without its gated norm: with it, training takes the unfused path)."""
    model = build_model(family_config(family))
    _check_training(model, _ids(model, 2, 77))
    prompt = _ids(model, 2, 20, seed=2)
    with it.enabled():
        assert set(it.describe(type(model).__module__).values()) == {"mamba2_cutile"}
        seq, steps = greedy_generate(model, prompt, 4)
    with it.torch_path():
        ref = teacher_forced_logits(model, seq, 20)
    if known_decode_bug(model):
        pytest.xfail(check_against_torch_decode(model, steps, seq, 20, ref, TOL, it.torch_path))
    assert rel_err(steps, ref) <= TOL


def test_mamba2_eval_forward_matches_torch_path(mamba2):
    ids = _ids(mamba2, 2, SEQLEN)
    with it.torch_path():
        ref = forward_logits(mamba2, ids)
    with it.enabled():
        ours = forward_logits(mamba2, ids)
    assert rel_err(ours, ref) <= TOL


def test_mamba2_generation_teacher_forced(mamba2):
    """8 new tokens from a 20-token prompt with the cache (prefill: conv + chunk scan
    adapters; decode: the two update adapters) against transformers' full forward on the
    same ids; greedy ids equal wherever the top-2 margin exceeds the tolerance."""
    prompt = _ids(mamba2, 2, 20, seed=3)
    with it.enabled():
        seq, step_logits = greedy_generate(mamba2, prompt, 8)
    with it.torch_path():
        ref_logits = teacher_forced_logits(mamba2, seq, prompt.shape[1])
        ref_seq, _ = greedy_generate(mamba2, prompt, 8)
    err = rel_err(step_logits, ref_logits)
    print(f"teacher-forced logits {err:.2e}")
    assert err <= TOL
    tol = TOL * ref_logits.abs().max().item()
    compared, differ = greedy_agreement(seq[:, 20:], ref_seq[:, 20:], ref_logits, tol)
    assert compared > 0 and differ == 0


def _backbone_logits(model, ids, **kwargs):
    """Logits through `model.backbone`: transformers 5.24's Mamba2ForCausalLM.forward does not
    pass extra keyword arguments (seq_idx, cu_seq_lens_q) on to its backbone; the backbone
    and the hybrid families' models do."""
    hidden = model.backbone(input_ids=ids, use_cache=False, **kwargs)[0]
    return model.lm_head(hidden).float()


def _packing_kwargs(packing, seq_idx, cu, pos, max_len):
    kwargs = {"position_ids": pos}
    if packing in ("seq_idx", "both"):
        kwargs["seq_idx"] = seq_idx
    if packing in ("cu_seq_lens", "both"):
        kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_len,
                      max_length_k=max_len)
    return kwargs


@pytest.mark.parametrize("packing, mode", [("seq_idx", "train"), ("cu_seq_lens", "train"),
                                           ("both", "eval")])
def test_packed_batch_equals_sequences_apart(mamba2, packing, mode):
    """One packed row of 3 sequences (70, 1, 79 tokens: a sequence of one token, boundaries
    inside a chunk) gives each sequence's logits as if run alone through the PyTorch path;
    train mode runs the fused layer, eval mode the conv + chunk scan adapters."""
    seqs = [_ids(mamba2, 1, n, seed=10 + i) for i, n in enumerate((70, 1, 79))]
    ids, seq_idx, cu, pos = packed(seqs)
    kwargs = _packing_kwargs(packing, seq_idx, cu, pos, 79)
    with it.torch_path():
        apart = torch.cat([forward_logits(mamba2, s) for s in seqs], dim=1)
    mamba2.train(mode == "train")
    try:
        with it.enabled(), torch.no_grad():
            ours = _backbone_logits(mamba2, ids, **kwargs)
    finally:
        mamba2.eval()
    err = rel_err(ours, apart)
    print(f"packed {packing} {mode}: {err:.2e}")
    assert err <= TOL


@pytest.mark.parametrize("packing", ["seq_idx", "cu_seq_lens"])
def test_packed_hybrid_equals_sequences_apart(packing):
    """BambaForCausalLM passes the packing kwargs down itself; its attention layer keeps the
    sequences apart from the restarting position_ids."""
    model = build_model(small_bamba_config(mamba_chunk_size=64))
    seqs = [_ids(model, 1, n, seed=40 + i) for i, n in enumerate((45, 30))]
    ids, seq_idx, cu, pos = packed(seqs)
    kwargs = _packing_kwargs(packing, seq_idx, cu, pos, 45)
    with it.torch_path():
        apart = torch.cat([forward_logits(model, s) for s in seqs], dim=1)
    with it.enabled():
        ours = forward_logits(model, ids, **kwargs)
    err = rel_err(ours, apart)
    print(f"packed bamba {packing}: {err:.2e}")
    assert err <= TOL


def test_packed_training_gradients_equal_sequences_apart(small_mamba2):
    """The gradients of a packed training step (fused layer) equal the sum of the sequences'
    own steps through the PyTorch path, for the loss sum(logits * W) with a fixed random W."""
    seqs = [_ids(small_mamba2, 1, n, seed=20 + i) for i, n in enumerate((40, 90))]
    ids, seq_idx, _, pos = packed(seqs)
    w = torch.randn(1, ids.shape[1], small_mamba2.config.vocab_size,
                    generator=torch.Generator().manual_seed(5))
    small_mamba2.train()
    try:
        with it.enabled():
            small_mamba2.zero_grad(set_to_none=True)
            logits = _backbone_logits(small_mamba2, ids, seq_idx=seq_idx, position_ids=pos)
            (logits * w).sum().backward()
            packed_grads = {n: p.grad.clone() for n, p in small_mamba2.named_parameters()}
        with it.torch_path():
            small_mamba2.zero_grad(set_to_none=True)
            start = 0
            for s in seqs:
                n = s.shape[1]
                (_backbone_logits(small_mamba2, s) * w[:, start:start + n]).sum().backward()
                start += n
            apart = {n: p.grad.clone() for n, p in small_mamba2.named_parameters()}
    finally:
        small_mamba2.zero_grad(set_to_none=True)
        small_mamba2.eval()
    errs = grad_errors(packed_grads, apart)
    print(f"packed grads: worst {max(errs.values()):.2e}")
    assert max(errs.values()) <= TOL, {k: v for k, v in errs.items() if v > TOL}


def test_torch_path_mixes_packed_sequences(mamba2):
    """What enable() fixes: transformers' PyTorch path (unwrapped) ignores seq_idx, and the
    second sequence's logits differ from running it alone."""
    seqs = [_ids(mamba2, 1, n, seed=30 + i) for i, n in enumerate((50, 50))]
    ids, seq_idx, _, _ = packed(seqs)
    with it.torch_path(), torch.no_grad():
        mixed = _backbone_logits(mamba2, ids, seq_idx=seq_idx)[:, 50:]
        alone = _backbone_logits(mamba2, seqs[1])
    assert rel_err(mixed, alone) > 100 * TOL


def test_padded_training_batch_with_unfused_path(small_mamba2):
    """A left-padded training batch: enable(fused=False) gives the PyTorch path's logits on
    the real tokens; the fused layer (like mamba_ssm's) sees no padding mask and differs once
    the conv has a bias (zero at initialisation: randomised here, so padding matters)."""
    ids = _ids(small_mamba2, 2, 60, seed=7)
    mask = torch.ones_like(ids)
    mask[1, :13] = 0
    biases = [layer.mixer.conv1d.bias for layer in small_mamba2.backbone.layers]
    saved = [b.detach().clone() for b in biases]
    gen = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for b in biases:
            b.copy_(torch.randn(b.shape, generator=gen))
    small_mamba2.train()
    try:
        with torch.no_grad():
            with it.torch_path():
                ref = small_mamba2(input_ids=ids, attention_mask=mask, use_cache=False).logits
            with it.enabled(fused=False):
                ours = small_mamba2(input_ids=ids, attention_mask=mask, use_cache=False).logits
            with it.enabled():
                fused = small_mamba2(input_ids=ids, attention_mask=mask, use_cache=False).logits
    finally:
        small_mamba2.eval()
        with torch.no_grad():
            for b, v in zip(biases, saved):
                b.copy_(v)
    real = mask.bool()
    err, fused_err = rel_err(ours[real], ref[real]), rel_err(fused[real], ref[real])
    print(f"padded training batch: unfused {err:.2e}, fused {fused_err:.2e}")
    assert err <= TOL
    assert fused_err > 100 * TOL, "the padding did not reach the state: the check is vacuous"


def test_bad_packing_argument_names_it(mamba2):
    ids = _ids(mamba2, 1, 16)
    with it.enabled(), torch.no_grad(), pytest.raises(ValueError, match="seq_idx must have shape"):
        _backbone_logits(mamba2, ids, seq_idx=torch.zeros(1, 17, dtype=torch.int32))


def test_compiled_training_step_has_no_graph_break_in_the_mixer(mamba2):
    torch._dynamo.reset()
    ids = _ids(mamba2, 2, 64)
    mamba2.train()
    try:
        with it.enabled():
            explain = torch._dynamo.explain(mamba2)(input_ids=ids, labels=ids, use_cache=False)
    finally:
        mamba2.eval()
        torch._dynamo.reset()
    reasons = [str(r) for r in explain.break_reasons]
    in_mixer = [r for r in reasons if "Mixer" in r or "integrations" in r or "mamba2_cutile" in r]
    print(f"graphs {explain.graph_count}, breaks {explain.graph_break_count}: {reasons[:3]}")
    assert not in_mixer, in_mixer
    assert explain.graph_break_count == 0, reasons


def test_module_imported_again_while_enabled_is_restored():
    """A family module imported a second time while enabled (a fresh module object) is
    patched on import with its own originals, and disable() restores both objects."""
    name = "transformers.models.zamba2.modeling_zamba2"
    old = importlib.import_module(name)
    before = {n: old.__dict__[n] for n in it.NAMES}
    it.enable()
    try:
        del sys.modules[name]
        new = importlib.import_module(name)
        assert new is not old
        assert all(getattr(new, n).__module__ == it.__name__ for n in it.NAMES)
        originals_new = it._originals(new)
        assert all(getattr(originals_new[n], "__module__", None) != it.__name__
                   for n in it.NAMES)
    finally:
        it.disable()
        sys.modules[name] = old
    assert all(old.__dict__[n] is before[n] for n in it.NAMES)
    assert all(new.__dict__[n] is originals_new[n] for n in it.NAMES)


def test_whole_dim_norm_detection_and_adapter():
    """A family whose gated norm takes neither group_size nor n_groups (transformers 5.17's
    Mamba-2, Bamba, GraniteMoeHybrid) gets the fused adapter with one norm group: its output
    equals the layer's with norm_groups=1, and differs from mamba_ssm's grouped norm."""
    import types

    from mamba2_cutile.layer.fused import split_conv1d_scan_norm_groups

    class WholeRMSNormGated(torch.nn.Module):
        def __init__(self, hidden_size, eps=1e-6):
            super().__init__()

    class GroupedRMSNormGated(torch.nn.Module):
        def __init__(self, hidden_size, group_size, eps=1e-6):
            super().__init__()

    whole = types.ModuleType("whole_family")
    whole.WholeRMSNormGated = WholeRMSNormGated
    grouped = types.ModuleType("grouped_family")
    grouped.GroupedRMSNormGated = GroupedRMSNormGated
    assert it._norm_is_whole(whole) and not it._norm_is_whole(grouped)
    assert not it._norm_is_whole(types.ModuleType("no_norm"))
    assert it._adapters(True, whole)["mamba2_split_conv1d_scan_combined"] is \
        it.whole_norm_split_conv1d_scan_combined
    assert it._adapters(True, grouped)["mamba2_split_conv1d_scan_combined"] is \
        it.mamba2_split_conv1d_scan_combined

    g = torch.Generator().manual_seed(0)
    h, p, ng, n, b, l = 4, 8, 2, 8, 1, 40
    dim = h * p
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    args = (r(b, l, 2 * dim + 2 * ng * n + h), r(dim + 2 * ng * n, 4) * 0.3, r(dim + 2 * ng * n),
            r(h) * 0.3, -torch.rand(h, generator=g, dtype=torch.float64) - 0.5, r(h), 64)
    kw = dict(rmsnorm_weight=1 + 0.1 * r(dim), headdim=p, ngroups=ng, norm_before_gate=False)
    ours_whole = it.whole_norm_split_conv1d_scan_combined(*args, **kw)
    ours_grouped = it.mamba2_split_conv1d_scan_combined(*args, **kw)
    torch.testing.assert_close(ours_whole, split_conv1d_scan_norm_groups(*args, **kw,
                                                                         norm_groups=1))
    torch.testing.assert_close(ours_grouped, split_conv1d_scan_norm_groups(*args, **kw,
                                                                           norm_groups=ng))
    assert (ours_whole - ours_grouped).abs().max() > 1e-3
    with pytest.raises(ValueError, match="norm_groups"):
        split_conv1d_scan_norm_groups(*args, **kw, norm_groups=3)
