"""The float64 cuTile emulation of `support.emulator`, extended with what the conv1d kernels
use: `Array.slice`, `ct.static_iter`, loads and stores with an axis `order` (and with
`check_bounds=False`, asserting that the tile lies inside the array), masked `scatter` and
`gather`, `cat`, `truediv` and `exp2` with their options (exact in float64). Runs the
kernels' own source on CPU tensors, one program at a time."""


import torch

from support import emulator
from support.emulator import CT, _tile


class EmuArray(torch.Tensor):
    """A kernel argument: a torch tensor with cuTile's `Array.slice`. A slice remembers its
    parent, so that a store through it is checked for races against the parent's owners
    (the emulator keys its owner maps by the array object, and a per-program view is a new
    object whose id a later program's view may reuse)."""

    def slice(self, axis, start, stop):
        start, stop = int(start), int(stop)
        assert 0 <= start < self.shape[axis] and start <= stop <= self.shape[axis], \
            (axis, start, stop, tuple(self.shape))
        view = self.narrow(axis, start, stop - start)
        view._emu_parent = (self, axis, start)
        return view


def _owners(array):
    """The emulator's owner map of `array`: for a slice, the matching view of its root's."""
    parent = getattr(array, "_emu_parent", None)
    if parent is None:
        return CT.owner.setdefault(id(array), torch.full(array.shape, -1, dtype=torch.int64))
    base, axis, start = parent
    return _owners(base).narrow(axis, start, array.shape[axis])


def _assert_inside(array, index, shape):
    """check_bounds=False promises a tile wholly inside the array: hold the kernel to it."""
    for i, n, size in zip(index, shape, array.shape):
        assert 0 <= int(i) * n and (int(i) + 1) * n <= size, \
            ("unchecked tile outside the array", tuple(index), tuple(shape), tuple(array.shape))


def _load(array, index, shape, order="C", padding_mode=None, check_bounds=True, **kw):
    if order != "C":
        array = array.permute(*order)
    if not check_bounds:
        _assert_inside(array, index, (shape,) if isinstance(shape, int) else shape)
    return _plain_load(array, index, shape, padding_mode=padding_mode, **kw)


def _store(array, index, tile, order="C", check_bounds=True, **kw):
    owners = _owners(array) if getattr(array, "_emu_parent", None) is not None else None
    if order != "C":
        array = array.permute(*order)
        owners = owners.permute(*order) if owners is not None else None
    if not check_bounds:
        _assert_inside(array, index, tuple(tile.shape))
    if owners is None:
        return _plain_store(array, index, tile, **kw)
    CT.owner[id(array)] = owners
    try:
        return _plain_store(array, index, tile, **kw)
    finally:
        del CT.owner[id(array)]


def _scatter(array, indices, value, mask=None, check_bounds=True, latency=None):
    idx = torch.broadcast_tensors(*(torch.as_tensor(i, dtype=torch.int64) for i in indices))
    ok = torch.ones(idx[0].shape, dtype=torch.bool)
    for i, size in zip(idx, array.shape):
        ok &= (i >= 0) & (i < size)
    if mask is not None:
        ok &= torch.as_tensor(mask, dtype=torch.bool).expand(ok.shape)
    vals = torch.as_tensor(value).as_subclass(torch.Tensor).expand(ok.shape)
    sel = tuple(i.as_subclass(torch.Tensor)[ok] for i in idx)
    array.as_subclass(torch.Tensor)[sel] = vals[ok].to(array.dtype)


def _gather(array, indices, mask=None, padding_value=0, check_bounds=True, latency=None):
    plain = lambda t: t.as_subclass(torch.Tensor) if isinstance(t, torch.Tensor) else t  # noqa
    return _plain_gather(plain(array), tuple(plain(i) for i in indices), mask=plain(mask),
                         padding_value=padding_value)


_plain_gather = emulator.FakeCT.gather
_plain_load, _plain_store = emulator.FakeCT.load.__get__(CT), emulator.FakeCT.store.__get__(CT)
CT.load = _load
CT.store = _store
CT.scatter = _scatter
CT.gather = _gather
CT.static_iter = lambda it: it
CT.cat = staticmethod(lambda tiles, axis: _tile(torch.cat(tuple(tiles), axis)))


def run_calls(calls):
    """Every program of each planned launch, in order (arguments wrapped as EmuArray)."""
    for call in calls:
        args = tuple(a.as_subclass(EmuArray) if isinstance(a, torch.Tensor) else a
                     for a in call.args)
        emulator.run_call(type(call)(call.kernel, call.grid, args))


__all__ = ["run_calls", "EmuArray", "_tile"]
