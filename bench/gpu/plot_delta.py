"""Plots `ferry bench e2e --delta --json` lines by link: the dense and the delta update beside each
other (seconds, log scale), each bar pair labelled with delta's speedup over dense in the same run.

usage: plot_delta.py RESULTS.jsonl OUT.png [BUILD]
  RESULTS: lines as bench/gpu/run.sh writes them, with "build" and "mbit_per_connection" added
  (docs/results/h200-run104-*.jsonl); BUILD: the build to plot (default "new"). At TP 2 a cap of
  N Mbit/s per connection is a 2N Mbit/s link from the trainer; 0 is an unpaced loopback.
"""
import json
import statistics
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(results, png, build="new"):
    rows = [json.loads(l) for l in open(results) if l.startswith("{")]
    rows = [r for r in rows if r.get("bench") == "e2e-delta" and r.get("build", "new") == build]
    if not rows:
        print("no e2e-delta lines to plot")
        return
    by_link = {}
    for r in rows:
        by_link.setdefault(r.get("mbit_per_connection", 0), []).append(r)
    # Slowest link first; the unpaced loopback last.
    links = sorted(by_link, key=lambda m: (m == 0, m))
    dense = [statistics.median(r["dense"]["seconds"] for r in by_link[m]) for m in links]
    delta = [statistics.median(r["delta"]["seconds"] for r in by_link[m]) for m in links]
    names = [f"{2 * m / 1000:g} Gbit/s" if m else "loopback" for m in links]
    fig, ax = plt.subplots(figsize=(7, 4))
    x = range(len(links))
    ax.bar([i - 0.2 for i in x], dense, width=0.4, label="dense update (same run)")
    ax.bar([i + 0.2 for i in x], delta, width=0.4, label="delta update")
    for i in x:
        ax.text(i, max(dense[i], delta[i]), f"{dense[i] / delta[i]:.1f}x", ha="center", va="bottom", fontsize=9)
    ax.set_yscale("log")
    ax.set_xticks(list(x))
    ax.set_xticklabels(names)
    ax.set_ylabel("update seconds (median)")
    r = rows[0]
    ax.set_title(f'{r["case"]}, TP {r["tp"]}, {r["bytes"] / 1e6:.0f} MB, '
                 f'{100 * r["changed_fraction"]:.2f}% changed per Adam step; labels: delta vs dense')
    ax.title.set_fontsize(9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)


if __name__ == "__main__":
    main(*sys.argv[1:])
