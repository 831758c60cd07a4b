"""Plots benchmark lines (JSON per line) as throughput beside each line's same-run baseline."""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(results, png):
    rows = [json.loads(l) for l in open(results) if l.startswith("{")]
    rows = [r for r in rows if r.get("bench") == "kernels"]
    if not rows:
        print("no kernels lines to plot")
        return
    fig, ax = plt.subplots(figsize=(10, 4))
    labels = [f'{r["case"]}\n{r["device"]}' for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["gbps"] for r in rows], width=0.4, label="ferry kernel")
    ax.bar([i + 0.2 for i in x], [r["baseline_gbps"] for r in rows], width=0.4, label="copy baseline (same run)")
    for i, r in enumerate(rows):
        ax.text(i, max(r["gbps"], r["baseline_gbps"]), f'{r["ratio"]:.2f}', ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("GB/s (bytes read + written)")
    ax.set_title("quantization kernels vs copy baseline; labels: ratio")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
