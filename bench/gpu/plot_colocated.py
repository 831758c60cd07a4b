"""Plots the colocated update per scheme: seconds per update for ferry, its memory floor, and the
PyTorch baselines, all from one results file (JSON lines with "bench": "colocated"), for one model
(the third argument: llama3-8b by default, or qwen3-30b-a3b)."""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


TITLES = {"llama3-8b": "Llama-3-8B shape",
          "qwen3-30b-a3b": "Qwen3-30B-A3B shape: a tensor per expert, or -stacked per layer"}


def main(results, png, model="llama3-8b"):
    rows = [json.loads(l) for l in open(results) if l.startswith("{")]
    rows = [r for r in rows if r.get("bench") == "colocated" and r.get("model", "llama3-8b") == model]
    if not rows:
        print("no colocated lines to plot")
        return
    schemes = sorted({r["case"].split("/", 1)[1] for r in rows})
    series = {}  # label -> {scheme: seconds}
    floors = {}
    for r in rows:
        who, scheme = r["case"].split("/", 1)
        who = who.replace("-" + model, "")
        series.setdefault(who, {})[scheme] = r["seconds"]
        if who.startswith("ferry") and "floor_seconds" in r:
            floors.setdefault(scheme, r["floor_seconds"])
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
    ax.set_title(f"colocated update, {TITLES.get(model, model)}, one GPU")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


if __name__ == "__main__":
    main(*sys.argv[1:4])
