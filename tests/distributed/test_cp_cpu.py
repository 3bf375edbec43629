"""CPU: context parallelism (`distributed.chunk_scan_cp`) in 2 and 3 processes on the gloo
backend, through the PyTorch path in float64, against the single-process scan of the whole
sequence: every rank's outputs, its true end state, and every gradient (per-token ones slice by
slice, the replicated A, D, dt_bias as the sum of the ranks' partial sums, initial_states from
rank 0) within 1e-6 relative. The carried states cross the wire in float32 (the state's dtype
on the GPU), so the expected error is float32 rounding of the states, measured 1e-8..1e-7;
the bound is 1e-6 as the spec states. Plus the one-process simulation of the same stages
(`simulate_ranks`), world size 1 without a process group, and the argument errors.
"""

import math
import os

import pytest
import torch
import torch.multiprocessing as mp

from mamba2_cutile import mamba_chunk_scan_combined
from mamba2_cutile.distributed import bytes_sent_per_rank, chunk_scan_cp, simulate_ranks

import cp_cases
from support.grads import assert_grads_close

TOL = 1e-6


def _rel(a, ref):
    return ((a.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)
            ).item()


def _spawn(world, tmp_path):
    port = cp_cases.free_port()
    mp.start_processes(cp_cases.worker, args=(world, port, str(tmp_path)), nprocs=world,
                       join=True, start_method="spawn")
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _combine(per_rank, lengths, ref_grads):
    """The ranks' gradients as one dict like the single process's (a rank whose slice is
    empty has no graph to its per-token leaves: None, counted as zeros; the replicated
    parameters get a gradient on every rank, zero on an empty slice, as DDP expects)."""
    got = {}
    for k in cp_cases.NAMES:
        if k in cp_cases.REPLICATED and ref_grads[k] is not None:
            missing = [i for i, r in enumerate(per_rank) if r["grads"][k] is None]
            assert not missing, f"d{k}: no gradient on rank(s) {missing}"
        grads = [r["grads"][k] if r["grads"][k] is not None else torch.zeros_like(ref_grads[k])
                 for r in per_rank] if ref_grads[k] is not None else None
        if ref_grads[k] is None:
            got[k] = None
        elif k in cp_cases.PER_TOKEN:
            got[k] = torch.cat([gr[:, sum(lengths[:i]):sum(lengths[:i + 1])]
                                for i, gr in enumerate(grads)], dim=1)
        elif k in cp_cases.REPLICATED:
            got[k] = sum(grads)
        else:   # initial_states: only rank 0's slice uses it
            assert not any(gr.any() for gr in grads[1:])
            got[k] = grads[0]
    return got


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_against_single_process(world, tmp_path):
    results = _spawn(world, tmp_path)
    for name, lengths in cp_cases.CASES[world]:
        per_rank = [res[(name, lengths)] for res in results]
        ref = cp_cases.single_process(name, lengths)
        y = torch.cat([r["y"] for r in per_rank], dim=1)
        assert y.dtype == ref["y"].dtype == torch.float64
        e = _rel(y, ref["y"])
        assert e <= TOL, f"{name} {lengths}: out error {e:.2e}"
        for r, (res, fin) in enumerate(zip(per_rank, ref["finals"])):
            assert res["final"].dtype == torch.float32
            e = _rel(res["final"], fin)
            assert e <= TOL, f"{name} {lengths}: rank {r} end state error {e:.2e}"
        assert_grads_close(_combine(per_rank, lengths, ref["grads"]), ref["grads"], TOL)
    for r, res in enumerate(results):
        assert len(res["errors"]) == 5, f"rank {r}: {res['errors']}"


@pytest.mark.parametrize("name,lengths", [("all", (70, 80)), ("all", (64, 0, 64, 22)),
                                          ("seq_idx", (1, 63, 1, 85)),
                                          ("bias_softplus_limit", (150,))])
def test_simulated_ranks(name, lengths):
    """The same stages in one process (the GPU simulation's code path), outputs, states at
    every slice end and gradients against the whole sequence."""
    ref = cp_cases.single_process(name, lengths)
    inp, dout = cp_cases.problem(name)
    leaves = cp_cases._leaves(inp)
    dfins = cp_cases.cotangents(len(lengths), ref["finals"][0].shape)
    y, finals = simulate_ranks(lengths, **leaves, chunk_size=cp_cases.Q)
    assert _rel(y, ref["y"]) <= TOL
    for f, fr in zip(finals, ref["finals"]):
        assert _rel(f, fr) <= TOL
    loss = (y * dout).sum() + sum((f.double() * d).sum() for f, d in zip(finals, dfins))
    loss.backward()
    got = {k: None if ref["grads"][k] is None else leaves[k].grad for k in cp_cases.NAMES}
    assert_grads_close(got, ref["grads"], TOL)


def test_world_size_one_is_the_scan():
    """Without a process group (and WORLD_SIZE unset) chunk_scan_cp is one rank: the scan."""
    inp, _ = cp_cases.problem("all")
    y, h = chunk_scan_cp(**inp, chunk_size=64, return_final_states=True)
    y0, h0 = mamba_chunk_scan_combined(**inp, chunk_size=64, return_final_states=True)
    assert torch.equal(y, y0) and torch.equal(h, h0)
    assert torch.equal(chunk_scan_cp(**inp, chunk_size=64), y0)


def test_errors_without_process_group(monkeypatch):
    inp, _ = cp_cases.problem("none")
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_scan_cp(**inp, chunk_size=64, cu_seqlens=torch.tensor([0, 150]))
    with pytest.raises(ValueError, match="return_varlen_states"):
        chunk_scan_cp(**inp, chunk_size=64, return_varlen_states=True)
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_scan_cp(**inp, chunk_size=96)
    with pytest.raises(ValueError, match="dt must have shape"):
        chunk_scan_cp(**dict(inp, dt=inp["dt"][:, :10]), chunk_size=64)
    with pytest.raises(ValueError, match="group is given"):
        chunk_scan_cp(**inp, chunk_size=64, group=object())
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="init_process_group"):
        chunk_scan_cp(**inp, chunk_size=64)
    with pytest.raises(ValueError, match="lengths"):
        simulate_ranks([100, 10], **inp, chunk_size=64)


def test_bytes_sent_per_rank():
    got = bytes_sent_per_rank(1, 80, 64, 128, 2)
    piece = 4 * 80 * (64 * 128 + 1)
    assert got == {"forward": piece, "backward": piece}
    assert bytes_sent_per_rank(2, 8, 4, 4, 4, seq_idx=True)["forward"] == 3 * (
        4 * 2 * 8 * 17 + 48)
    assert bytes_sent_per_rank(1, 8, 4, 4, 1) == {"forward": 0, "backward": 0}
    assert math.isclose(piece / 2**20, 2.5, rel_tol=1e-3)    # 2.5 MiB at the 2.7B layer


def test_torch_compile_runs_it_eagerly():
    """chunk_scan_cp is excluded from compilation (eager collectives, a host read): a
    compiled function that calls it gives the eager result."""
    inp, _ = cp_cases.problem("D_chan_z")

    def f(x, dt):
        return chunk_scan_cp(**dict(inp, x=x, dt=dt), chunk_size=64) * 2

    got = torch.compile(f, backend="eager")(inp["x"], inp["dt"])
    assert torch.equal(got, f(inp["x"], inp["dt"]))


def test_whole_slice_correction_equals_live_prefix():
    """Under CUDA-graph capture the correction covers the whole slice (no host read of the
    live prefix's length): the same result, the skipped tokens' term being below the
    smallest normal number."""
    from mamba2_cutile.distributed import context_parallel as cp
    inp, _ = cp_cases.problem("D_head_z_seq")
    lengths = (40, 110)
    locs = [cp.local_scan(**{k: (v[:, a:b] if k in cp_cases.PER_TOKEN + ("seq_idx",) and
                                 v is not None else v) for k, v in inp.items()}, chunk_size=64)
            for a, b in ((0, 40), (40, 150))]
    gathered = torch.stack([loc.piece() for loc in locs])
    infos = torch.stack([loc.seq_info for loc in locs])
    C, z = inp["C"][:, 40:], inp["z"][:, 40:]
    term = cp.carried_term(locs[1], gathered[0, :-8].reshape(2, 4, 5, 6), C, z,
                           cp.crossing(infos, 2)[0], 1, full_prefix=False)
    assert 0 < term.shape[1] < lengths[1]        # the live prefix ends inside the slice
    got = [cp.finish(locs[1], gathered, infos, 1, 2, C, z=z, full_prefix=full)
           for full in (False, True)]
    assert torch.equal(got[0][1], got[1][1])
    assert _rel(got[1][0], got[0][0]) <= 1e-15


def test_bench_script_simulate_mode_runs(monkeypatch, tmp_path):
    """scripts/cp_bench.py's one-GPU simulation, run on the CPU (its hidden --device cpu puts
    wall-clock stand-ins in place of the CUDA events): the rows it writes."""
    import json
    import runpy
    for name in ("Event", "synchronize", "empty_cache", "max_memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, getattr(torch.cuda, name))   # restored after
    path = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "cp_bench.py")
    bench = runpy.run_path(path)
    out = tmp_path / "sim.json"
    bench["main"](["--device", "cpu", "--simulate", "2", "--tokens", "300", "--heads", "2",
                   "--headdim", "8", "--dstate", "8", "--chunk", "64", "--dtype", "fp32",
                   "--warmup", "0", "--reps", "1", "--json", str(out)])
    row, = json.loads(out.read_text())["results"]
    assert row["world"] == 2 and len(row["per_rank_ms"]) == 2
    assert row["out_rel_err_vs_whole"] <= 1e-5
    assert row["bytes_sent_per_rank"]["forward"] == 4 * 2 * (8 * 8 + 1)


def test_simulated_ranks_keep_bad_input_where_the_scan_has_it():
    """A NaN in one packed sequence, or an A = -inf head with a dt' of 0, gives what the scan
    over the whole sequence gives: the exchange selects away another sequence's state and
    forms no -inf * 0 (it multiplied by 0 / 1 masks, and NaN reached the next sequence)."""
    inp, _ = cp_cases.problem("seq_idx")
    inp = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in inp.items()}
    inp["x"][0, 30] = float("nan")           # row 0, its first sequence, rank 0
    y0, h0 = mamba_chunk_scan_combined(**inp, chunk_size=64, return_final_states=True)
    y, finals = simulate_ranks((70, 80), **inp, chunk_size=64)
    assert torch.equal(y.isfinite(), y0.isfinite()) and finals[-1].isfinite().all()
    ok = y0.isfinite()
    assert _rel(y[ok], y0[ok]) <= TOL and _rel(finals[-1], h0) <= TOL

    inp, _ = cp_cases.problem("none")
    inp["A"] = inp["A"].clone()
    inp["A"][1] = -math.inf
    inp["dt"] = inp["dt"].clone()
    inp["dt"][:, 20] = -1.0                  # dt' = 0 there (no softplus, the default clamp)
    y0, h0 = mamba_chunk_scan_combined(**inp, chunk_size=64, return_final_states=True)
    y, finals = simulate_ranks((70, 80), **inp, chunk_size=64)
    assert y.isfinite().all() and all(f.isfinite().all() for f in finals)
    assert _rel(y, y0) <= TOL and _rel(finals[-1], h0) <= TOL
