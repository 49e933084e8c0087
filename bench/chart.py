"""The kernel benchmark as a picture: ours against the peers and the targets, from a run's JSON.

    python3 bench/chart.py bench/results/kernels-2026-12-01.json [--out PNG]

Three panels: decode GB/s per shape (ours at the auto split, FlashInfer tensor-core and CUDA-core,
torch SDPA on contiguous KV; the 3.8 TB/s target and the copy ceiling as lines), causal prefill
TFLOP/s (ours, FlashInfer paged, SDPA: the target is SDPA itself), and the cache ops as % of their
ceilings (reshape_and_cache and copy_blocks of the copy ceiling, swap of pinned cudaMemcpy) with
their targets. bench/kernels.py draws it beside its table when matplotlib is installed.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DECODE_IMPLS = [("ours", lambda i: i.startswith("ua") and i.endswith("(auto)")),
                ("FlashInfer tensor-core", lambda i: i == "FlashInfer tensor-core"),
                ("FlashInfer CUDA-core", lambda i: i == "FlashInfer CUDA-core"),
                ("torch SDPA (contiguous KV)", lambda i: i == "torch SDPA contiguous")]
PREFILL_IMPLS = [("ours", lambda i: i == "ua"), ("FlashInfer paged", lambda i: i == "FlashInfer paged"),
                 ("torch SDPA (contiguous KV)", lambda i: i == "torch SDPA contiguous")]
COLORS = {"ours": "#d62728", "FlashInfer tensor-core": "#1f77b4", "FlashInfer CUDA-core": "#aec7e8",
          "FlashInfer paged": "#1f77b4", "torch SDPA (contiguous KV)": "#7f7f7f"}


def _grouped(ax, rows, op, metric, impls, title, unit):
    """Bars of `metric` for each shape of `op` (x) and implementation (bar); missing cells stay empty."""
    shapes = list(dict.fromkeys(r["shape"] for r in rows if r["op"] == op))
    width = 0.8 / len(impls)
    for k, (name, match) in enumerate(impls):
        xs, ys = [], []
        for s, shape in enumerate(shapes):
            hit = [r[metric] for r in rows if r["op"] == op and r["shape"] == shape and match(r["impl"]) and metric in r]
            if hit:
                xs.append(s - 0.4 + width * (k + 0.5))
                ys.append(hit[0])
        bars = ax.bar(xs, ys, width, label=name, color=COLORS.get(name))
        ax.bar_label(bars, fmt="%.0f", fontsize=6, padding=1)
    ax.set_xticks(range(len(shapes)), [s.replace(" causal", "") for s in shapes], fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(unit)
    return shapes


def label(target: str, shape: str) -> str:
    """A cache-op bar's label in a few short lines: the op, then its dtypes (page size) or direction."""
    op = {"reshape_and_cache": "reshape", "copy_blocks": "copy_blocks", "swap": "swap"}[target.split(" %")[0]]
    words = shape.split()
    if words[0] in ("d2h", "h2d"):
        return f"{op}\n{words[0]}"
    keep = [w for w in words if "->" in w or w == "+rope" or (op == "copy_blocks" and (w.startswith("P=") or
                                                                                      w in ("bf16", "fp16", "int8")))]
    return "\n".join([op] + [w.replace("->", " to\n") for w in keep])


def draw(meta: dict, png: Path) -> Path:
    """Writes the three-panel chart of one run's meta (bench/kernels.py's JSON, whose `targets` holds the
    target checks) to png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, checks = meta["rows"], meta["targets"]
    decode_goal = next((c["goal"] for c in checks if c["target"].startswith("decode")), None)
    fig, (dec, pre, cache) = plt.subplots(1, 3, figsize=(16, 4.8), gridspec_kw=dict(width_ratios=[4, 2, 4.5]))
    _grouped(dec, rows, "decode", "gbps", DECODE_IMPLS, "paged decode (bf16, Hq 32, Hkv 8, D 128, page 16)", "GB/s")
    if decode_goal:
        dec.axhline(decode_goal, color="#d62728", ls="--", lw=1, label=f"target {decode_goal / 1000:g} TB/s")
    if meta.get("copy_ceiling_gbps"):
        dec.axhline(meta["copy_ceiling_gbps"], color="black", ls=":", lw=1, label="copy ceiling")
    dec.set_ylim(0, 1.3 * max(max(dec.get_ylim()), meta.get("copy_ceiling_gbps") or 0))
    dec.legend(fontsize=7, loc="upper left", ncol=3)
    _grouped(pre, rows, "prefill", "tflops", PREFILL_IMPLS, "causal paged prefill (target: SDPA)", "TFLOP/s")
    pre.set_ylim(0, 1.4 * pre.get_ylim()[1])
    pre.legend(fontsize=7, loc="upper left")
    checks = [c for c in checks if "%" in c["target"]]
    labels = [label(c["target"], c["shape"]) for c in checks]
    bars = cache.bar(range(len(checks)), [c["measured"] for c in checks],
                     color=["#2ca02c" if c["met"] else "#d62728" for c in checks])
    cache.bar_label(bars, fmt="%.0f%%", fontsize=7, padding=1)
    for i, c in enumerate(checks):
        cache.hlines(c["goal"], i - 0.4, i + 0.4, colors="black", linestyles="--", lw=1)
    cache.set_xticks(range(len(checks)), labels, fontsize=7)
    cache.set_ylim(0, 110)
    cache.set_title("cache ops, % of their ceiling (dashed: target)", fontsize=10)
    fig.suptitle(f"uacompile kernels on {meta['gpu']}, {meta['date']} (one run, implementations interleaved)",
                 fontsize=11)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=130)
    plt.close(fig)
    return png


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", help="a bench/kernels.py JSON (kernels-<date>.json)")
    ap.add_argument("--out", help="PNG path (default: the JSON's path with .png)")
    a = ap.parse_args(argv)
    src = Path(a.json)
    if not src.exists():
        print(f"bench/chart.py: no such file {src}", file=sys.stderr)
        return 2
    print(draw(json.loads(src.read_text()), Path(a.out) if a.out else src.with_suffix(".png")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
