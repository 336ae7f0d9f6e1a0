#!/usr/bin/env python3
"""Draws the loss curves of ferry train --log files as one SVG (no plotting library needed).

usage: tools/plot_curves.py --out curves.svg [--title T] [--smooth N] [--from STEP] LABEL=LOG.jsonl ...

Each log's "loss" per "step" is drawn as a line (steps whose loss is null are left out), averaged
over a window of N steps (--smooth, default 1: as logged), from step STEP on (--from: the first
steps' losses, far above the rest, would flatten the curves). The last averaged value of each is
written in the legend and printed, so that the curves can be compared in numbers too.
"""
import argparse
import json
import sys

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]


def read_log(path):
    pts = []
    with open(path) as f:
        for line in f:
            if not line.startswith("{"):
                continue
            r = json.loads(line)
            if r.get("loss") is not None:
                pts.append((r["step"], r["loss"]))
    if not pts:
        sys.exit(f"plot_curves: {path} holds no step with a loss")
    return pts


def smooth(pts, n):
    out = []
    for i in range(len(pts)):
        w = pts[max(0, i - n + 1): i + 1]
        out.append((pts[i][0], sum(p[1] for p in w) / len(w)))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", default="training loss")
    ap.add_argument("--smooth", type=int, default=1)
    ap.add_argument("--from", dest="start", type=int, default=0)
    ap.add_argument("curves", nargs="+", help="LABEL=LOG.jsonl")
    a = ap.parse_args()
    if a.smooth < 1:
        sys.exit("plot_curves: --smooth takes a window of at least 1 step")
    series = []
    for c in a.curves:
        if "=" not in c:
            sys.exit(f"plot_curves: '{c}' is not LABEL=LOG.jsonl")
        label, path = c.split("=", 1)
        pts = [p for p in smooth(read_log(path), a.smooth) if p[0] >= a.start]
        if not pts:
            sys.exit(f"plot_curves: {path} has no step from {a.start} on")
        series.append((label, pts))
    xs = [p[0] for _, s in series for p in s]
    ys = [p[1] for _, s in series for p in s]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if x1 == x0:
        x1 = x0 + 1
    if y1 == y0:
        y1 = y0 + 1
    W, H, L, R, T, B = 720, 420, 60, 20, 40, 50
    px = lambda x: L + (x - x0) / (x1 - x0) * (W - L - R)
    py = lambda y: T + (1 - (y - y0) / (y1 - y0)) * (H - T - B)
    o = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
         f'<rect width="{W}" height="{H}" fill="white"/>',
         f'<text x="{W / 2}" y="20" text-anchor="middle" font-size="14">{a.title}</text>',
         f'<line x1="{L}" y1="{H - B}" x2="{W - R}" y2="{H - B}" stroke="black"/>',
         f'<line x1="{L}" y1="{T}" x2="{L}" y2="{H - B}" stroke="black"/>']
    for i in range(5):
        x = x0 + (x1 - x0) * i / 4
        y = y0 + (y1 - y0) * i / 4
        o.append(f'<text x="{px(x):.1f}" y="{H - B + 16}" text-anchor="middle">{x:.0f}</text>')
        o.append(f'<text x="{L - 6}" y="{py(y) + 4:.1f}" text-anchor="end">{y:.2f}</text>')
        o.append(f'<line x1="{L}" y1="{py(y):.1f}" x2="{W - R}" y2="{py(y):.1f}" stroke="#ddd"/>')
    o.append(f'<text x="{W / 2}" y="{H - 12}" text-anchor="middle">step</text>')
    o.append(f'<text x="14" y="{H / 2}" text-anchor="middle" transform="rotate(-90 14 {H / 2})">loss</text>')
    for k, (label, s) in enumerate(series):
        col = COLORS[k % len(COLORS)]
        d = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in s)
        o.append(f'<polyline fill="none" stroke="{col}" stroke-width="1.5" points="{d}"/>')
        last = s[-1][1]
        o.append(f'<text x="{W - R - 250}" y="{T + 16 + 16 * k}" fill="{col}">{label}: last {last:.4f}</text>')
        print(f"{label}: step {s[-1][0]}, loss {last:.4f} (window {a.smooth})")
    o.append("</svg>")
    with open(a.out, "w") as f:
        f.write("\n".join(o) + "\n")


if __name__ == "__main__":
    main()
