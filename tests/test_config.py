"""CPU: the config contract (mamba2_cutile.config): each family's config validates itself from
every source, each environment variable reaches its own family only, and errors name the
variable and the field."""

import pytest
import torch

from mamba2_cutile import config
from mamba2_cutile.bench import plans
from mamba2_cutile.decode import DecodeConfig, decode_config
from mamba2_cutile.ssd.backward import BackwardConfig, backward_config
from mamba2_cutile.ssd import forward
from mamba2_cutile.ssd.forward import ForwardConfig, forward_config, forward_shape_config

BF = torch.bfloat16


def fwd():
    return forward_shape_config(4, 8, 64, 128, 128, BF)


def bwd():
    return backward_config(4, 8, 1, 64, 128, 128, BF)


@pytest.mark.parametrize("make, bad", [
    (fwd, dict(state_block_n=48)), (fwd, dict(scan_block_q=256)), (fwd, dict(scan_warps=2)),
    (fwd, dict(state_load_latency=11)), (fwd, dict(scan_lowp=2)),
    (bwd, dict(dx_block_q=48)), (bwd, dict(da_mode=2, bc_fused=0)), (bwd, dict(dx_warps=2)),
    (bwd, dict(bc_load_latency=-1)), (bwd, dict(dx_block_q=256)),
    (lambda: decode_config(4, 8, 64, 128), dict(block_p=48)),
    (lambda: decode_config(4, 8, 64, 128), dict(warps=2)),
])
def test_every_config_validates_itself(make, bad):
    """A bad value raises ValueError naming the field, however the config is built."""
    from dataclasses import replace
    cfg = make()
    field = next(iter(bad))
    with pytest.raises(ValueError, match=field):
        replace(cfg, **bad)


@pytest.mark.parametrize("env, family, make", [
    (config.ENV_FORWARD, ForwardConfig, lambda: forward_config(4, 8, 64, 128, 128, BF)),
    (config.ENV_BACKWARD, BackwardConfig, bwd),
    (config.ENV_DECODE, DecodeConfig, lambda: decode_config(4, 8, 64, 128)),
])
def test_env_errors_name_the_variable(env, family, make, monkeypatch):
    monkeypatch.setenv(env, "nope=1")
    with pytest.raises(ValueError, match=f"{env}: unknown field 'nope'"):
        make()
    monkeypatch.setenv(env, f"{family.FIXED[-1]}=64")       # set by the problem
    with pytest.raises(ValueError, match=env):
        make()
    monkeypatch.setenv(env, "x")                            # no '='
    with pytest.raises(ValueError, match=env):
        make()


def test_each_variable_reaches_its_own_family_only(monkeypatch):
    """MAMBA2_CUTILE_CONFIG changes the forward, never the backward's recompute of the forward's
    kernels; MAMBA2_CUTILE_BWD_CONFIG changes the backward, never the forward."""
    base_fwd = forward_config(4, 8, 64, 128, 128, BF)
    base_plan = plans.backward_problem_plan()
    monkeypatch.setenv(config.ENV_FORWARD, "state_block_n=16,state_load_latency=2")
    over = forward_config(4, 8, 64, 128, 128, BF)
    assert (over.state_block_n, over.state_load_latency) == (16, 2)
    assert bwd() == backward_config(4, 8, 1, 64, 128, 128, BF)
    plan = plans.backward_problem_plan()
    for a, b in zip(base_plan, plan):
        assert a.grid == b.grid and a.kernel is b.kernel
        assert [x for x in a.args if not isinstance(x, torch.Tensor)] == \
            [x for x in b.args if not isinstance(x, torch.Tensor)]
    monkeypatch.delenv(config.ENV_FORWARD)
    monkeypatch.setenv(config.ENV_BACKWARD, "dx_block_q=32,lowp=0")
    assert (bwd().dx_block_q, bwd().lowp) == (32, 0)
    assert forward_config(4, 8, 64, 128, 128, BF) == base_fwd


def test_backward_chunk_rule_and_override(monkeypatch):
    """A chunk-256 call computes its backward at chunk 128; the variable can ask for 256."""
    assert backward_config(2, 80, 1, 64, 128, 256, BF).chunk_size == 128
    assert backward_config(2, 80, 1, 64, 128, 64, BF).chunk_size == 64
    monkeypatch.setenv(config.ENV_BACKWARD, "chunk_size=256")
    assert backward_config(2, 80, 1, 64, 128, 256, BF).chunk_size == 256


def test_parse_overrides():
    assert config.parse_overrides(ForwardConfig, "state_block_n=32, scan_lowp=1", "src") == \
        {"state_block_n": 32, "scan_lowp": 1}
    with pytest.raises(ValueError, match="src: scan_lowp='a' is not an integer"):
        config.parse_overrides(ForwardConfig, "scan_lowp=a", "src")


@pytest.mark.parametrize("batch, nheads, headdim, dstate, chunk, dtype, tiles", [
    (4, 8, 64, 128, 128, BF, (32, 0)),          # seed: 128 programs of 64 x 32
    (2, 24, 64, 128, 128, BF, (32, 2)),         # 192 programs of 64 x 32
    (2, 48, 64, 128, 128, BF, (128, 2)),        # 96 of the whole state: kept, two per SM
    (2, 32, 64, 128, 128, BF, (128, 2)),        # 64 whole-state programs: whole
    (1, 49, 64, 128, 128, BF, (128, 2)),        # three eighths of the SMs: whole
    (1, 48, 64, 128, 128, BF, (32, 2)),         # fewer: 96 of 64 x 64 -> 192 of 64 x 32
    (2, 32, 64, 256, 128, BF, (128, 0)),        # a 256-wide state: split as before
    (2, 48, 64, 128, 128, torch.float32, (64, 0)),  # fp32: split as before
    (1, 98, 64, 128, 128, BF, (128, 2)),        # three quarters of the SMs less one: whole
    (1, 99, 64, 128, 128, BF, (128, 0)),        # 99 to 132 whole programs: one per SM
    (2, 64, 64, 128, 128, BF, (128, 0)),        # 128 of the whole state
    (2, 80, 64, 128, 128, torch.float16, (128, 2)),  # 160 > 132: two per SM
    (2, 80, 64, 64, 128, BF, (64, 2)),          # a 64-wide whole state is not halved
    (2, 48, 64, 128, 64, BF, (64, 0)),          # chunk 64: as before
    (2, 48, 256, 128, 256, BF, (128, 0)),       # computed at chunk 256: as before
    (2, 48, 128, 128, 256, BF, (128, 2)),       # chunk 256 computed at 128 (headdim 128)
    (2, 80, 64, 128, 128, torch.float32, (128, 0)),  # no hint for fp32
    (1, 1, 20, 7, 128, torch.float64, (16, 0))])     # the smallest tile
def test_state_pass_tiles(batch, nheads, headdim, dstate, chunk, dtype, tiles):
    """The state pass's n-tile and occupancy (`forward.state_tiles`): the widest tile whose
    grid gives most SMs a program; past one program per SM, two per SM (16-bit inputs at
    chunk 128) with a 64-wide tile of a wider state halved; a whole 128-wide state on three
    eighths to three quarters of the SMs stays whole, two per SM. The backward's recompute of the states takes
    the same."""
    from mamba2_cutile.ssd.backward import _recompute_config, backward_shape_config
    cfg = forward_shape_config(batch, nheads, headdim, dstate, chunk, dtype, 132)
    assert (cfg.state_block_n, cfg.state_occupancy) == tiles
    if chunk <= 128:
        bcfg = backward_shape_config(batch, nheads, 1, headdim, dstate, chunk, dtype, 132)
        rec = _recompute_config(bcfg, batch, nheads, headdim, dstate, dtype)
        assert (bcfg.state_block_n, bcfg.state_occupancy) == tiles
        assert (rec.state_block_n, rec.state_occupancy) == tiles


@pytest.mark.parametrize("slices, dstate, dtype, tiles", [
    (24, 128, BF, (16, 2)),                # B=1 T=512 H=24: 192 programs of 64 x 16
    (24, 128, torch.float16, (16, 2)),
    (48, 128, BF, (32, 2)),                # 192 of 64 x 32
    (160, 128, BF, (128, 0)),              # a 128-wide tile two per SM spills: one
    (24, 128, torch.float32, (16, 0)),     # no hint for fp32
    (16, 128, BF, (16, 0))])               # 128 programs: one wave, one per SM
def test_state_pass_tiles_chunk256(slices, dstate, dtype, tiles):
    """At chunk 256 itself (short sequences: the output launch is not chunk_scan_group, so
    the call is not computed at 128) a state-pass grid past one program per SM takes two per
    SM where its tile is at most 64 wide; the three-kernel forward at B=1 T=512 H=24 takes
    it (where varlen states need the chunk states; otherwise the short walk runs there)."""
    assert forward.state_tiles(slices, dstate, dstate, 256, dtype, 132) == tiles
    if slices == 24 and dtype == BF:
        cfg = forward_config(1, 24, 64, 128, 256, BF, 132, seqlen=512, walk_ok=False)
        assert (cfg.chunk_size, cfg.scan_walk, cfg.state_block_n, cfg.state_occupancy) == (
            256, 0, 16, 2)
        assert forward_config(1, 24, 64, 128, 256, BF, 132, seqlen=512) == (
            forward.short_walk_config(cfg))


@pytest.mark.parametrize("batch, nheads, headdim, dstate, dtype, tiles", [
    (2, 80, 64, 128, BF, (64, 128, 2)),          # 160 whole-state programs
    (2, 48, 128, 128, BF, (64, 128, 2)),         # two p-tiles a head: 192
    (4, 8, 64, 128, BF, (64, 128, 2)),           # seed: 32 programs, still whole
    (1, 2, 32, 64, torch.float16, (32, 64, 2)),  # small: the padded whole
    (2, 80, 64, 256, BF, (32, 256, 0)),          # dstate 256 in 16 bits: 32 x 256
    (2, 80, 64, 200, torch.float16, (32, 256, 0)),
    (2, 80, 16, 256, BF, (16, 256, 0)),          # headdim 16: one 16-wide tile
    (2, 80, 64, 256, torch.float32, (64, 256, 0)),   # fp32: the forward's tiles
    (2, 80, 64, 128, torch.float32, (64, 128, 0))])
def test_reverse_state_pass_tiles(batch, nheads, headdim, dstate, dtype, tiles):
    """bwd_state_pass's (p-tile, n-tile, occupancy): the whole state (64 channels) at two per
    SM whatever the grid; a 256-wide state in 16 bits 32 x 256 tiles, fp32 inputs the
    forward's state tiles."""
    from mamba2_cutile.ssd.backward import backward_shape_config
    cfg = backward_shape_config(batch, nheads, 1, headdim, dstate, 256, dtype, 132)
    assert (cfg.bstate_block_p, cfg.bstate_block_n, cfg.bstate_occupancy) == tiles


@pytest.mark.parametrize("batch, seqlen, nheads, headdim, dstate, dtype, has_z, tiles", [
    (2, 8192, 80, 64, 128, BF, False, (64, 4, 2)),          # 2.7B: 64 channels, 4 warps
    (4, 16384, 8, 64, 128, torch.float16, False, (64, 4, 2)),  # seed problem in fp16
    (2, 8192, 32, 64, 256, BF, False, (64, 8, 0)),          # dstate 256: 8 warps, no hint
    (4, 16384, 24, 40, 24, BF, False, (64, 4, 2)),          # headdim 40 pads to 64
    (2, 8192, 80, 64, 128, BF, True, (32, 4, 2)),           # z: the key-block loop stays
    (1, 512, 64, 64, 128, BF, False, (32, 4, 2)),           # short: head split, da_mode 1
    (1, 1024, 64, 64, 128, BF, False, (64, 4, 2)),          # 16 fused programs: the dS launch
    (1, 2048, 64, 64, 128, BF, False, (64, 4, 2)),          # 32 fused programs: the dS launch
    (2, 8192, 48, 128, 128, BF, False, (64, 4, 2)),         # headdim 128 keeps 4 warps
    (2, 8192, 80, 64, 128, torch.float32, False, (32, 4, 0)),  # fp32
    (2, 8192, 80, 32, 128, BF, False, (32, 4, 2))])         # headdim 32: one 32-wide tile
def test_dx_tiles(batch, seqlen, nheads, headdim, dstate, dtype, has_z, tiles):
    """bwd_chunk_dx's (channels, warps, occupancy): all 64 channels of a 16-bit headdim-64
    head with 4 warps (8 at dstate 256) where the launch has no key-block loop (da_mode 3, no
    z); 32 channels with 4 warps otherwise, headdim 128 in 64-channel programs of 4 warps."""
    from mamba2_cutile.ssd.backward import backward_shape_config
    cfg = backward_shape_config(batch, nheads, 1, headdim, dstate, 256, dtype, 132, seqlen,
                                has_z)
    assert (cfg.dx_block_p, cfg.dx_warps, cfg.dx_occupancy) == tiles
    assert cfg.da_mode == (1 if seqlen == 512 else 3)


@pytest.mark.parametrize("dstate, over, tiles", [
    (128, {"bc_fused": 1}, (32, 4)),                 # da_mode reset to 1 with the launch
    (128, {"da_mode": 1}, (32, 4)),
    (128, {"bc_fused": 1, "dx_block_p": 64}, (64, 4)),  # named: kept
    (128, {"dx_warps": 8}, (64, 8)),                  # da_mode 3 stays
    (256, {"bc_fused": 1}, (32, 8))])                 # dstate 256 keeps its 8 warps
def test_leaving_da_mode_3_takes_the_narrow_dx_tiles(dstate, over, tiles):
    """An override that leaves da_mode 3 without naming bwd_chunk_dx's tiles takes them back
    from the 64-channel programs (measured only without the key-block loop)."""
    from dataclasses import replace

    from mamba2_cutile.ssd.backward import backward_shape_config
    cfg = backward_shape_config(2, 80, 1, 64, dstate, 256, BF, 132, 8192)
    assert (cfg.da_mode, cfg.dx_block_p) == (3, 64)
    got = replace(cfg, **cfg.paired_overrides(over))
    assert (got.dx_block_p, got.dx_warps) == tiles


def test_leaving_da_mode_3_hand_built_config_keeps_its_tiles():
    """A config built without the dispatcher records no headdim (headdim_pad 0): leaving
    da_mode 3 resets da_mode only, never the dx tiles it names."""
    from dataclasses import replace

    from mamba2_cutile.ssd.backward import backward_shape_config
    cfg = replace(backward_shape_config(2, 80, 1, 64, 128, 256, BF, 132, 8192), headdim_pad=0)
    got = replace(cfg, **cfg.paired_overrides({"bc_fused": 1}))
    assert (got.da_mode, got.dx_block_p, got.dx_warps) == (1, 64, 4)


@pytest.mark.parametrize("over", [{"bc_fused": 1}, {"da_mode": 1}])
def test_leaving_da_mode_3_keeps_headdim_128_tiles(over):
    """Headdim 128's 64-channel, 4-warp programs are its key-block-loop tiles too: leaving
    da_mode 3 keeps them (the config records the headdim it was made for)."""
    from dataclasses import replace

    from mamba2_cutile.ssd.backward import backward_shape_config
    cfg = backward_shape_config(2, 48, 1, 128, 128, 256, BF, 132, 8192)
    assert (cfg.da_mode, cfg.dx_block_p, cfg.dx_warps, cfg.headdim_pad) == (3, 64, 4, 128)
    got = replace(cfg, **cfg.paired_overrides(over))
    assert (got.da_mode, got.dx_block_p, got.dx_warps) == (1, 64, 4)
