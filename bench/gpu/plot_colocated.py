"""Plots the colocated update per scheme: seconds per update for ferry, its memory floor, and the
PyTorch baselines, all from one results file (JSON lines with "bench": "colocated")."""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(results, png):
    rows = [json.loads(l) for l in open(results) if l.startswith("{")]
    rows = [r for r in rows if r.get("bench") == "colocated"]
    if not rows:
        print("no colocated lines to plot")
        return
    schemes = sorted({r["case"].split("/", 1)[1] for r in rows})
    series = {}  # label -> {scheme: seconds}
    floors = {}
    for r in rows:
        who, scheme = r["case"].split("/", 1)
        series.setdefault(who, {})[scheme] = r["seconds"]
        if who == "ferry" and "floor_seconds" in r:
            floors[scheme] = r["floor_seconds"]
    series = {"floor (3 B/param at copy speed)": floors, **series}
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / max(1, len(series))
    for k, (label, vals) in enumerate(series.items()):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(schemes))]
        ys = [vals.get(s, 0) * 1e3 for s in schemes]
        ax.bar(xs, ys, width=width, label=label)
        for x, y in zip(xs, ys):
            if y:
                ax.text(x, y, f"{y:.0f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(schemes)))
    ax.set_xticklabels(schemes)
    ax.set_yscale("log")
    ax.set_ylabel("ms per update (log)")
    ax.set_title("colocated update, Llama-3-8B shape, one GPU")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
