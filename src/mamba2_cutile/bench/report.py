"""Writers for benchmark rows (see runner): a terminal table (rich, else plain text), JSON,
CSV and a matplotlib PNG (kernel time and speedup against sequence length), and the progress
bar used while the runner works. rich and matplotlib are imported lazily: the `bench`
optional dependencies (`pip install -e ".[bench]"`)."""

from __future__ import annotations

import csv
import json
import math
import os

from .impls import LABELS, OURS, ORDER

#: CSV columns first in this order; any further flattened keys follow, sorted
CSV_FIRST = ("shape", "mode", "impl", "status", "batch", "seqlen", "nheads", "ngroups",
             "headdim", "dstate", "chunk", "dtype", "options", "graph_median_ms",
             "graph_min_ms", "graph_max_ms", "graph_n", "eager_median_ms", "eager_min_ms",
             "eager_max_ms", "eager_n", "first_call_s", "peak_mem_mib", "floor_ms",
             "pct_of_floor", "floor_bound", "floor_bytes", "floor_flops", "ours_speedup",
             "checked_against", "max_diff_vs_first")
DIM_NAMES = ("batch", "seqlen", "nheads", "ngroups", "headdim", "dstate", "chunk")


def flatten(row: dict) -> dict:
    """One level of keys for CSV: graph.median_ms -> graph_median_ms, dims -> batch.. chunk,
    speedup_vs.mamba_ssm -> speedup_vs_mamba_ssm, lists joined with '+'."""
    out = {}
    for k, v in row.items():
        if k == "dims" and isinstance(v, (list, tuple)) and len(v) == len(DIM_NAMES):
            out.update(zip(DIM_NAMES, v))
        elif isinstance(v, dict):
            for k2, v2 in v.items():
                out[f"{k}_{k2}"] = v2
        elif isinstance(v, (list, tuple)):
            out[k] = "+".join(str(x) for x in v)
        else:
            out[k] = v
    return out


def _jsonable(obj):
    if isinstance(obj, float) and (math.isnan(obj) or math.isinf(obj)):
        return None if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)


def write_json(path, rows, meta=None, breakdown=None):
    """{"meta": ..., "versions": ..., "rows": [...], "breakdown": [...]} (strict JSON: NaN ->
    null). `versions` is repeated at the top level, as in the earlier results files."""
    doc = {"meta": meta or {}, "versions": (meta or {}).get("versions", {}), "rows": rows}
    if breakdown:
        doc["breakdown"] = breakdown
    _ensure_dir(path)
    with open(path, "w") as f:
        json.dump(_jsonable(doc), f, indent=1, allow_nan=False)
    return path


def write_csv(path, rows):
    flat = [flatten(r) for r in rows]
    keys = [k for k in CSV_FIRST if any(k in r for r in flat)]
    keys += sorted({k for r in flat for k in r} - set(keys))
    _ensure_dir(path)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        for r in flat:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in keys})
    return path


def _ensure_dir(path):
    d = os.path.dirname(os.fspath(path))
    if d:
        os.makedirs(d, exist_ok=True)


def _timed(rows):
    """(row, kernel-time median in ms) of the rows that were timed."""
    for r in rows:
        g = r.get("graph")
        if g and g.get("median_ms"):
            yield r, g["median_ms"]


def _series(rows):
    """{series: {impl: [(seqlen, ms)]}} of timed rows, sorted by seqlen."""
    out = {}
    for r, ms in _timed(rows):
        out.setdefault(r.get("series", r["shape"]), {}).setdefault(r["impl"], []).append(
            (r["dims"][1], ms))
    for impls in out.values():
        for pts in impls.values():
            pts.sort()
    return out


def _by_shape(rows):
    """[(label, {impl: ms}, floor_ms)] of timed rows, one per shape in the rows' order."""
    out = {}
    for r, ms in _timed(rows):
        dims = ", ".join(str(d) for d in r["dims"])
        entry = out.setdefault(r["shape"], (f"{r['shape']} ({dims})", {}, r.get("floor_ms")))
        entry[1][r["impl"]] = ms
    return list(out.values())


def _suptitle(fig, meta):
    v = (meta or {}).get("versions", {})
    fig.suptitle(f"{v.get('gpu', '?')} | {(meta or {}).get('roofline', '')} | "
                 f"TileGym {(meta or {}).get('tilegym', '?')}", fontsize=8)


def _write_png_shapes(plt, path, rows, meta):
    """Per-shape bars, for sets whose shapes mostly have one sequence length each (`models`):
    kernel time per implementation with the roofline floor marked, and our speedup over each
    baseline (the line at 1: even)."""
    shapes = _by_shape(rows)
    impls = [i for i in ORDER if any(i in t for _, t, _ in shapes)]
    impls += sorted({i for _, t, _ in shapes for i in t} - set(impls))
    baselines = [i for i in impls if i != OURS]
    n = len(shapes)
    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(14, 1.2 + 0.42 * n), sharey=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    h = 0.8 / max(1, len(impls))
    ys = list(range(n))
    for k, impl in enumerate(impls):
        pos = [y - 0.4 + h * (k + 0.5) for y in ys]
        ax_t.barh(pos, [t.get(impl, 0.0) for _, t, _ in shapes], height=h,
                  color=colors[k % len(colors)], label=LABELS.get(impl, impl))
    floors = [(y, f) for y, (_, _, f) in zip(ys, shapes) if f]
    if floors:
        ax_t.scatter([f for _, f in floors], [y for y, _ in floors], marker="|", s=200,
                     color="black", label="floor", zorder=3)
    h = 0.8 / max(1, len(baselines))
    for k, impl in enumerate(baselines):
        pos = [y - 0.4 + h * (k + 0.5) for y in ys]
        sp = [t[impl] / t[OURS] if impl in t and OURS in t else 0.0 for _, t, _ in shapes]
        ax_s.barh(pos, sp, height=h, color=colors[(impls.index(impl)) % len(colors)],
                  label=f"vs {LABELS.get(impl, impl)}")
    mode = (meta or {}).get("mode", "fwd")
    ax_t.set(xscale="log", xlabel="kernel time (ms, CUDA graph median)",
             title=f"{mode}: kernel time")
    ax_t.set_yticks(ys, [label for label, _, _ in shapes], fontsize=7)
    ax_t.invert_yaxis()
    ax_s.set(xlabel="speedup of mamba2-cutile (baseline time / ours)",
             title=f"{mode}: speedup (> 1: mamba2-cutile faster)")
    ax_s.axvline(1.0, color="gray", lw=0.8)
    for ax in (ax_t, ax_s):
        ax.grid(True, axis="x", which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="best")
    _suptitle(fig, meta)
    fig.tight_layout()
    _ensure_dir(path)
    fig.savefig(path, dpi=120, bbox_inches="tight")       # the shape labels are long
    plt.close(fig)
    return path


def write_png(path, rows, meta=None):
    """Two panels against sequence length: kernel time per implementation (log-log), and our
    speedup over each baseline. One line per (series, implementation); a series is a shape
    family that differs only in T. Where most series have one sequence length (the `models`
    set), per-shape bars instead (`_write_png_shapes`). Returns the path, or None when
    matplotlib is missing or nothing was timed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    series = _series(rows)
    if not series:
        return None
    lengths = [max(len(pts) for pts in by_impl.values()) for by_impl in series.values()]
    if 2 * sum(1 for k in lengths if k == 1) > len(lengths):
        return _write_png_shapes(plt, path, rows, meta)
    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(14, 5.5))
    styles = {name: st for name, st in zip(ORDER, ("-o", "--s", ":^", "-.v"))}
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (ser, by_impl) in enumerate(sorted(series.items())):
        color = colors[i % len(colors)]
        for impl, pts in by_impl.items():
            xs, ys = zip(*pts)
            ax_t.plot(xs, ys, styles.get(impl, "-x"), color=color,
                      label=f"{LABELS.get(impl, impl)} | {ser}")
        ours = dict(by_impl.get(OURS, []))
        for impl, pts in by_impl.items():
            if impl == OURS or not ours:
                continue
            sp = [(t, ms / ours[t]) for t, ms in pts if t in ours]
            if sp:
                xs, ys = zip(*sp)
                ax_s.plot(xs, ys, styles.get(impl, "-x"), color=color,
                          label=f"vs {LABELS.get(impl, impl)} | {ser}")
    mode = (meta or {}).get("mode", "fwd")
    ax_t.set(xscale="log", yscale="log", xlabel="sequence length T",
             ylabel="kernel time (ms, CUDA graph median)", title=f"{mode}: kernel time")
    ax_s.set(xscale="log", yscale="log", xlabel="sequence length T",
             ylabel="speedup of mamba2-cutile (baseline time / ours)",
             title=f"{mode}: speedup (> 1: mamba2-cutile faster)")
    ax_s.axhline(1.0, color="gray", lw=0.8)
    for ax in (ax_t, ax_s):
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, loc="best")
    _suptitle(fig, meta)
    fig.tight_layout()
    _ensure_dir(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_all(out_dir, rows, meta=None, breakdown=None, stem=None):
    """JSON, CSV and PNG under out_dir as bench-<mode>.{json,csv,png}; {kind: path or None}."""
    stem = stem or f"bench-{(meta or {}).get('mode', 'fwd')}"
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, stem)
    return {"json": write_json(base + ".json", rows, meta, breakdown),
            "csv": write_csv(base + ".csv", rows),
            "png": write_png(base + ".png", rows, meta)}


# --------------------------------------------------------------------------- table

def make_console():
    """A rich Console: the terminal's width on a terminal, 200 columns when the output goes to
    a file or pipe (logs keep one line per row)."""
    from rich.console import Console

    c = Console()
    return c if c.is_terminal else Console(width=200)


def _ms(v):
    return "" if v is None else f"{v:.3f}" if v >= 0.1 else f"{v:.4f}"


def _status_style(s):
    if s == "ok":
        return "green"
    if s.startswith("MISMATCH") or s.startswith("error"):
        return "bold red"
    return "yellow"


def table_data(rows):
    """(columns, list of (cells, status)) shared by the rich and the plain table."""
    baselines = [n for n in ORDER if n != OURS and any(r["impl"] == n for r in rows)]
    baselines += sorted({r["impl"] for r in rows} - set(ORDER))
    cols = ["shape", "impl", "status", "kernel ms med (min-max)", "eager ms", "first s",
            "floor ms", "% floor", "peak MiB", "diff"]
    cols += [f"x vs {LABELS.get(b, b)}" for b in baselines]
    out = []
    for r in rows:
        g, e = r.get("graph"), r.get("eager")
        kern = (f"{_ms(g['median_ms'])} ({_ms(g['min_ms'])}-{_ms(g['max_ms'])})" if g
                else ("graph failed" if r.get("graph_error") else ""))
        diff = ""
        if r.get("max_diff_vs_first") is not None:
            diff = f"{r['max_diff_vs_first']:.1e} vs {LABELS.get(r['checked_against'], '')}"
        elif r.get("status") == "ok" and g:
            diff = "(first: the others are checked against it)"
        cells = [r["shape"], LABELS.get(r["impl"], r["impl"]), r["status"], kern,
                 _ms(e["median_ms"]) if e else "",
                 f"{r['first_call_s']:.2f}" if r.get("first_call_s") is not None else "",
                 _ms(r.get("floor_ms")),
                 f"{r['pct_of_floor']:.1f}" if r.get("pct_of_floor") is not None else "",
                 f"{r['peak_mem_mib']:.0f}" if r.get("peak_mem_mib") is not None else "",
                 diff]
        sp = r.get("speedup_vs", {})
        cells += [f"{sp[b]:.2f}x" if b in sp else "" for b in baselines]
        out.append((cells, r["status"]))
    return cols, out


def caption(meta):
    meta = meta or {}
    v = meta.get("versions", {})
    parts = [f"mode {meta.get('mode', '?')}", f"GPU {v.get('gpu', '?')}",
             f"floor = max(bytes/HBM, FLOPs/TC) with {meta.get('roofline', '')}",
             f"TileGym: {meta.get('tilegym', '?')}",
             "x vs B: B's kernel time / ours (> 1: ours faster)"]
    return " | ".join(parts)


def render_table(rows, meta=None, console=None, title="mamba2-cutile benchmark"):
    """Print the table with rich."""
    from rich.console import Console
    from rich.table import Table

    cols, data = table_data(rows)
    console = console or Console()
    t = Table(title=title, caption=caption(meta), show_lines=False)
    for c in cols:
        t.add_column(c, overflow="fold", justify="left" if c in ("shape", "impl", "status",
                                                                    "diff") else "right")
    prev = None
    for cells, status in data:
        if prev is not None and cells[0] != prev:
            t.add_section()
        prev = cells[0]
        cells = list(cells)
        cells[2] = f"[{_status_style(status)}]{cells[2]}[/]"
        t.add_row(*cells)
    console.print(t)


def render_breakdown(rows, console=None):
    if not rows:
        return
    lines = []
    for r in rows:
        ks = ", ".join(f"{k} {v:.4f} ms" for k, v in r.get("kernels", {}).items())
        lines.append(f"breakdown {r['shape']}: {ks} (sum {r.get('total_ms', 0):.4f} ms)\n"
                     f"  {r.get('config', '')}")
    text = "\n".join(lines)
    if console is not None:
        console.print(text, highlight=False, markup=False)
    else:
        print(text)


# --------------------------------------------------------------------------- progress

class Progress:
    """A rich progress bar over `total` steps. Use as a context manager; `step(text)` marks the
    start of the next step."""

    def __init__(self, total, description="bench", console=None, enabled=True):
        self.total, self.description, self.console = total, description, console
        self.enabled = enabled
        self._bar = None
        self._task = None
        self._n = 0

    def __enter__(self):
        if self.enabled:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress as RichProgress,
                                       TextColumn, TimeElapsedColumn)
            self._bar = RichProgress(TextColumn("{task.description}"), BarColumn(),
                                     MofNCompleteColumn(), TimeElapsedColumn(),
                                     console=self.console, transient=False)
            self._bar.__enter__()
            self._task = self._bar.add_task(self.description, total=self.total)
        return self

    def step(self, text=""):
        if self._bar is None:
            return
        if self._n:
            self._bar.advance(self._task)
        self._n += 1
        desc = f"{self.description}: {text}" if text else self.description
        self._bar.update(self._task, description=desc)

    def __exit__(self, *exc):
        if self._bar is not None:
            if self._n:
                self._bar.advance(self._task)
            self._bar.update(self._task, description=self.description)
            self._bar.__exit__(*exc)
        return False
