"""PNG charts of benchmark results (matplotlib is an optional extra: `pip install tileflash[plot]`).

One chart per suite: for each shape, one bar per backend; prefill/backward in TFLOP/s, decode in GB/s.
"""
from __future__ import annotations

import os

METRIC = {"prefill": "TFLOP/s", "backward": "TFLOP/s", "decode": "GB/s", "lowp": "GB/s"}


def _label(suite: str, row: dict) -> str:
    if suite in ("prefill", "backward"):
        return f"d{row['d']}{' c' if row['causal'] else ''} {row['seqlen'] // 1024}k"
    return f"{row['label']} b{row['batch']} {row['ctx'] // 1024}k"


def series(suite: str, rows: list[dict]) -> tuple[list[str], dict[str, list]]:
    """(shape labels, {backend: [metric or None per shape]}) — the data a chart shows; pure, so it is testable."""
    metric = METRIC[suite]
    names = [n for n in rows[0]["backends"]] if rows else []
    data = {n: [(r["backends"].get(n) or {}).get(metric) for r in rows] for n in names}
    return [_label(suite, r) for r in rows], {n: v for n, v in data.items() if any(x is not None for x in v)}


def write_charts(results: dict, directory: str) -> list[str]:
    """Write <directory>/<suite>.png for every suite in `results`; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    paths = []
    for suite, rows in results.items():
        if suite not in METRIC or not rows:
            continue
        labels, data = series(suite, rows)
        fig, ax = plt.subplots(figsize=(max(8, 0.5 * len(labels) * max(len(data), 1)), 4.5))
        width = 0.8 / max(len(data), 1)
        for i, (name, values) in enumerate(data.items()):
            xs = [j + i * width for j in range(len(labels))]
            ax.bar(xs, [v or 0 for v in values], width, label=name)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))], labels, rotation=60, ha="right",
                      fontsize=7)
        ax.set_ylabel(METRIC[suite])
        ax.set_title(f"tileflash {suite} vs peers")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(directory, f"{suite}.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths
