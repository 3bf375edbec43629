"""A float64 PyTorch emulation of the cuTile operations the kernels use, to run the kernels'
own source on a CPU, one program instance at a time.

`ct.load` partitions the array into tiles of the given shape and indexes that tile space;
out-of-bounds elements are 0 with PaddingMode.ZERO and NaN otherwise (so a reliance on undefined
padding shows up); a tile lying entirely outside the array is an error; `ct.store` drops the
out-of-bounds part; with `check_bounds=False` a tile reaching past the array is an error (on the
GPU an access outside it). Every program of every grid runs in turn (the same grids and argument lists
the launch plans build for the GPU); `poison` fills scratch buffers with NaN (a read of
something no program wrote poisons the result), and each array element may be written by one
program of a launch only (two programs writing one slot would be a race on the GPU).

Also the small float64 problems the emulation tests share (`make_problem`, `OPTIONS`).
"""

import math
import types

import torch

F64 = torch.float64


# ----------------------------------------------------------------------------------------------
# the emulated cuTile
# ----------------------------------------------------------------------------------------------

class Tile(torch.Tensor):
    """A torch tensor with the cuTile tile methods the kernels call."""

    def astype(self, dtype):
        if dtype in (torch.int32, torch.int64, torch.int16, torch.int8):
            return self.to(torch.int64)
        if dtype is torch.bool:
            return self.to(torch.bool)
        return self.to(F64)       # every float type (and tf32): exact float64 arithmetic

    def transpose(self, *dims):
        if not dims:
            return self.permute(*reversed(range(self.dim())))
        return super().transpose(*dims)


def _tile(t):
    return t.as_subclass(Tile)


def _t(v, like=None):
    if isinstance(v, torch.Tensor):
        return v
    if isinstance(v, bool):
        return _tile(torch.tensor(v))
    if isinstance(v, int) and not (isinstance(like, torch.Tensor) and like.is_floating_point()):
        return _tile(torch.tensor(v, dtype=torch.int64))
    return _tile(torch.tensor(float(v), dtype=F64))


class _Padding:
    ZERO = "zero"
    UNDETERMINED = "undetermined"


class FakeCT(types.SimpleNamespace):
    """The subset of `cuda.tile` the kernels use, on float64 torch tensors."""

    def __init__(self):
        super().__init__()
        self.float32, self.float16, self.bfloat16 = torch.float32, torch.float16, torch.bfloat16
        self.float64, self.int32, self.int64, self.bool_ = F64, torch.int32, torch.int64, torch.bool
        self.tfloat32 = "tfloat32"
        self.PaddingMode = _Padding
        self.pid = (0, 0, 0)
        self.grid = (1, 1, 1)
        self.owner = {}           # id(array) -> tensor of the program index that wrote each element
        self.program = 0
        self.touched = None       # {"r": ..., "w": ...}: storage bytes a launch read and wrote

    # grid
    def bid(self, axis):
        return self.pid[axis]

    def num_blocks(self, axis):
        return self.grid[axis]

    @staticmethod
    def cdiv(a, b):
        return -(-a // b)

    # creation
    @staticmethod
    def arange(n, dtype=None):
        return _tile(torch.arange(n, dtype=torch.int64))

    @staticmethod
    def full(shape, value, dtype=None):
        if dtype in (torch.int32, torch.int64):
            return _tile(torch.full(shape, int(value), dtype=torch.int64))
        return _tile(torch.full(shape, float(value), dtype=F64))

    # memory
    def load(self, array, index, shape, padding_mode=None, latency=None, **kw):
        if isinstance(shape, int):
            shape = (shape,)
        assert len(index) == len(shape) == array.dim(), (index, shape, array.shape)
        fill = 0 if padding_mode == _Padding.ZERO else (
            float("nan") if array.is_floating_point() else -(2**40))
        dt = F64 if array.is_floating_point() else torch.int64
        out = torch.full(shape, fill, dtype=dt)
        src, dst = [], []
        for i, s, size in zip(index, shape, array.shape):
            i = int(i)
            lo, hi = i * s, i * s + s
            a, b = max(lo, 0), min(hi, size)
            assert a < b, f"tile {index} x {shape} lies entirely outside {tuple(array.shape)}"
            assert kw.get("check_bounds", True) or (a, b) == (lo, hi), (
                f"unchecked load of tile {index} x {shape} reaches past {tuple(array.shape)}")
            src.append(slice(a, b))
            dst.append(slice(a - lo, b - lo))
        out[tuple(dst)] = array[tuple(src)].to(dt)
        self._touch("r", array, src)
        return _tile(out)

    def _touch(self, kind, array, region):
        """Record the storage bytes of array[region] as read ("r") or written ("w") by the
        current launch (only while a plan with side streams runs: `emulate_launch`)."""
        if self.touched is None:
            return
        st = array.untyped_storage()
        es = array.element_size()
        elems = torch.arange(st.nbytes() // es).as_strided(
            array.shape, array.stride(), array.storage_offset())[tuple(region)]
        mask = self.touched[kind].setdefault(st.data_ptr(), torch.zeros(st.nbytes(),
                                                                        dtype=torch.bool))
        mask[(elems.reshape(-1, 1) * es + torch.arange(es)).reshape(-1)] = True

    def store(self, array, index, tile, **kw):
        shape = tuple(tile.shape)
        assert len(index) == len(shape) == array.dim(), (index, shape, array.shape)
        src, dst = [], []
        for i, s, size in zip(index, shape, array.shape):
            i = int(i)
            lo, hi = i * s, i * s + s
            a, b = max(lo, 0), min(hi, size)
            assert a < b, f"store {index} x {shape} lies entirely outside {tuple(array.shape)}"
            assert kw.get("check_bounds", True) or (a, b) == (lo, hi), (
                f"unchecked store of tile {index} x {shape} reaches past {tuple(array.shape)}")
            dst.append(slice(a, b))
            src.append(slice(a - lo, b - lo))
        own = self.owner.setdefault(id(array), torch.full(array.shape, -1, dtype=torch.int64))
        prev = own[tuple(dst)]
        clash = (prev >= 0) & (prev != self.program)
        assert not clash.any(), f"two programs write one element of an array {tuple(array.shape)}"
        own[tuple(dst)] = self.program
        array[tuple(dst)] = torch.Tensor(tile)[tuple(src)].to(array.dtype)
        self._touch("w", array, dst)

    # math (rounding modes and flush-to-zero are accepted and ignored: float64 stands for
    # both the IEEE and the approximate forms)
    RoundingMode = types.SimpleNamespace(APPROX="approx", RN="nearest_even", FULL="full")

    @staticmethod
    def exp2(x, flush_to_zero=False):
        return torch.exp2(x)

    @staticmethod
    def truediv(x, y, rounding_mode=None, flush_to_zero=False):
        return x / y

    @staticmethod
    def exp(x):
        return torch.exp(x)

    @staticmethod
    def log(x):
        return torch.log(x)

    @staticmethod
    def where(cond, x, y):
        like = x if isinstance(x, torch.Tensor) else y
        return _tile(torch.where(cond, _t(x, like), _t(y, like)))

    @staticmethod
    def minimum(a, b, propagate_nan=False, flush_to_zero=False):
        """cuTile's min: a NaN operand is ignored unless propagate_nan (torch.fmin)."""
        if not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor):
            return min(a, b)
        like = a if isinstance(a, torch.Tensor) else b
        a, b = _t(a, like), _t(b, like)
        return _tile((torch.minimum if propagate_nan else torch.fmin)(a, b))

    @staticmethod
    def maximum(a, b, propagate_nan=False, flush_to_zero=False):
        """cuTile's max: a NaN operand is ignored unless propagate_nan (torch.fmax)."""
        if not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor):
            return max(a, b)
        like = a if isinstance(a, torch.Tensor) else b
        a, b = _t(a, like), _t(b, like)
        return _tile((torch.maximum if propagate_nan else torch.fmax)(a, b))

    @staticmethod
    def abs(x):
        return torch.abs(x)

    @staticmethod
    def isnan(x):
        return torch.isnan(_t(x))

    @staticmethod
    def sum(x, axis=None, keepdims=False):
        if axis is None:
            axis = tuple(range(x.dim()))
        return torch.sum(x, dim=axis, keepdim=keepdims)

    @staticmethod
    def max(x, axis=None, keepdims=False, propagate_nan=False, flush_to_zero=False):
        """cuTile's max reduction: NaN entries are ignored unless propagate_nan."""
        if axis is None:
            axis = tuple(range(x.dim()))
        if x.is_floating_point() and not propagate_nan:
            x = torch.where(torch.isnan(x), -math.inf, x)
        return torch.amax(x, dim=axis, keepdim=keepdims)

    @staticmethod
    def cumsum(x, axis=0, reverse=False):
        if reverse:
            return torch.flip(torch.cumsum(torch.flip(x, (axis,)), dim=axis), (axis,))
        return torch.cumsum(x, dim=axis)

    @staticmethod
    def scan(x, axis, func, identity, reverse=False):
        assert not reverse
        out, acc = [], _t(identity, x)
        for piece in torch.unbind(x, dim=axis):
            acc = func(acc, piece)
            out.append(acc)
        return _tile(torch.stack(out, dim=axis))

    @staticmethod
    def gather(array, indices, mask=None, padding_value=0, check_bounds=True, latency=None):
        idx = torch.broadcast_tensors(*(torch.as_tensor(i, dtype=torch.int64) for i in indices))
        ok = torch.ones(idx[0].shape, dtype=torch.bool)
        for i, size in zip(idx, array.shape):
            ok &= (i >= 0) & (i < size)
        if mask is not None:
            ok &= torch.as_tensor(mask, dtype=torch.bool)
        safe = tuple(torch.where(ok, i, 0) for i in idx)
        dt = F64 if array.is_floating_point() else torch.int64
        vals = array[safe].to(dt)
        CT._touch("r", array, tuple(i[ok] for i in idx))
        return _tile(torch.where(ok, vals, torch.as_tensor(padding_value, dtype=dt)))

    @staticmethod
    def mma(a, b, acc):
        assert a.dim() == b.dim() == acc.dim() == 2 and a.shape[1] == b.shape[0]
        assert acc.shape == (a.shape[0], b.shape[1])
        return acc + a @ b

    @staticmethod
    def static_iter(iterable):
        return list(iterable)

    @staticmethod
    def extract(x, index, shape):
        sl = tuple(slice(i * s, i * s + s) for i, s in zip(index, shape))
        return x[sl]

    @staticmethod
    def broadcast_to(x, shape):
        return x.expand(shape)


CT = FakeCT()
_globals_cache = {}


def _emu_globals(mod_globals):
    key = id(mod_globals)
    if key not in _globals_cache:
        g = dict(mod_globals)
        _globals_cache[key] = g
        g["ct"] = CT
        for name, val in list(g.items()):
            if isinstance(val, types.FunctionType) and \
                    val.__module__.startswith("mamba2_cutile.kernels"):
                g[name] = _emulated(val)
    return _globals_cache[key]


def _emulated(fn):
    """`fn` with its module's `ct` (and the helpers it calls) replaced by the emulation."""
    return types.FunctionType(fn.__code__, _emu_globals(fn.__globals__), fn.__name__,
                              fn.__defaults__, fn.__closure__)


def run_call(call):
    """All programs of one planned launch, in grid order."""
    fn = _emulated(call.kernel._annotated_function.pyfunc)
    CT.owner = {}             # launches are ordered on the stream: only races within one count
    grid = tuple(call.grid) + (1,) * (3 - len(call.grid))
    CT.grid = grid
    for z in range(grid[2]):
        for y in range(grid[1]):
            for x in range(grid[0]):
                CT.pid = (x, y, z)
                CT.program += 1
                fn(*call.args)


def may_overlap(calls):
    """Pairs (i, j), i < j, of launches that `runtime.launch_calls` may run at the same time:
    between two joins, a side-stream launch and any later launch on another stream (a side
    launch waits for the caller's stream, never the other way round before a join)."""
    epoch, epochs = 0, []
    for call in calls:
        epoch += bool(call.join)
        epochs.append(epoch)
    return [(i, j) for j in range(len(calls)) for i in range(j)
            if epochs[i] == epochs[j] and calls[i].stream
            and calls[i].stream != calls[j].stream]


def _clash(a, b):
    return any(k in b and (a[k] & b[k]).any() for k in a)


def emulate_launch(calls):
    """Run a plan's launches in their listed order. Where the plan puts launches on side
    streams, also check that no two launches that may run at the same time touch one byte
    that either of them writes (a race on the GPU whatever the listed order gives here)."""
    pairs = may_overlap(calls)
    seen = []
    for call in calls:
        CT.touched = {"r": {}, "w": {}} if pairs else None
        run_call(call)
        seen.append(CT.touched)
    CT.touched = None
    for i, j in pairs:
        a, b = seen[i], seen[j]
        assert not (_clash(a["w"], b["w"]) or _clash(a["w"], b["r"]) or _clash(b["w"], a["r"])), (
            f"launches {i} and {j} may run at the same time and touch one buffer, one writing it")


def poison(bufs):
    for t in bufs.__dict__.values():
        if t is not None and t.is_floating_point():
            t.fill_(float("nan"))


# ----------------------------------------------------------------------------------------------
# problems
# ----------------------------------------------------------------------------------------------

def make_seq_idx(b, l, Q):
    """Resets inside chunks, exactly on chunk boundaries, one token after one, at token 1,
    at the last token, one-token sequences, gaps in the ids, a row not starting at 0."""
    rows = ([1, 7, Q, Q + 1, 2 * Q - 1, l - 1], [Q - 1, Q, Q + 5, 2 * Q, 2 * Q + 3])
    seq = torch.zeros(b, l, dtype=torch.int32)
    for r in range(b):
        seq[r] = 3 * r
        for k, pos in enumerate(rows[r % 2]):
            if 0 < pos < l:
                seq[r, pos:] = 3 * r + 2 * (k + 1)
    return seq


def make_problem(opt, b=2, l=150, h=4, g=2, p=20, n=7, Q=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    args = dict(x=r(b, l, h, p), dt=r(b, l, h) * 0.5 + 0.3,
                A=-torch.rand(h, generator=gen, dtype=F64) - 0.5, B=r(b, l, g, n),
                C=r(b, l, g, n))
    kw = dict(D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
              dt_softplus=False, dt_limit=(0.0, math.inf))
    if opt.get("D") == "head":
        kw["D"] = r(h)
    if opt.get("D") == "chan":
        kw["D"] = r(h, p)
    if opt.get("z"):
        kw["z"] = r(b, l, h, p)
    if opt.get("dt_bias"):
        kw["dt_bias"] = r(h) * 0.3
        kw["dt_softplus"] = True
    if "dt_limit" in opt:
        kw["dt_limit"] = opt["dt_limit"]
    if opt.get("init"):
        kw["initial_states"] = r(b, h, p, n)
    if opt.get("seq_idx"):
        kw["seq_idx"] = make_seq_idx(b, l, Q)
    dout = r(b, l, h, p)
    dfinal = r(b, h, p, n) if opt.get("dfinal", True) else None
    return args, kw, dout, dfinal


OPTIONS = {
    "none": dict(),
    "D_head": dict(D="head"),
    "D_chan_z": dict(D="chan", z=True),
    "bias_softplus_limit": dict(dt_bias=True, dt_limit=(0.7, 1.1)),
    "limit_nosoftplus": dict(dt_limit=(0.2, 0.6)),
    "init_no_dfinal": dict(init=True, dfinal=False),
    "no_dfinal_no_init": dict(dfinal=False),
    "D_head_z_seq": dict(D="head", z=True, seq_idx=True),
    "seq_idx": dict(seq_idx=True),
    "all": dict(D="chan", z=True, dt_bias=True, dt_limit=(0.7, 1.1), init=True, seq_idx=True),
}
