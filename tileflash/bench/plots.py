"""PNG charts of benchmark results (matplotlib is an optional extra: `pip install tileflash[plot]`).

One chart per suite: for each shape, one bar per backend; prefill/backward in TFLOP/s, decode in GB/s. The lowp
suite holds two kinds of rows and gets two charts: its FP8-cache decode rows (lowp.png, GB/s) and its GEMM rows
(lowp-gemm.png, TFLOP/s).
"""
from __future__ import annotations

import os

METRIC = {"prefill": "TFLOP/s", "backward": "TFLOP/s", "decode": "GB/s", "lowp": "GB/s", "gemm": "TFLOP/s"}


def chart_kind(suite: str, row: dict) -> str:
    """The chart a row belongs to: its suite's, except GEMM rows (kind "gemm"), which get their own."""
    return "gemm" if row.get("kind") == "gemm" else suite


def _label(kind: str, row: dict) -> str:
    if kind in ("prefill", "backward"):
        return f"d{row['d']}{' c' if row['causal'] else ''} {row['seqlen'] // 1024}k"
    if kind == "gemm":
        return f"M{row['m']} {row['n'] // 1024}k"  # N = K
    return f"{row['label']} b{row['batch']} {row['ctx'] // 1024}k"


def series(suite: str, rows: list[dict]) -> tuple[list[str], dict[str, list]]:
    """(shape labels, {backend: [metric or None per shape]}) — the data a chart shows; pure, so it is testable.
    ``rows`` are of one chart kind (see chart_kind; write_charts splits a suite's rows by it)."""
    kinds = {chart_kind(suite, r) for r in rows}
    if len(kinds) > 1:
        raise ValueError(f"{suite}: rows of several kinds {sorted(kinds)}; split them with chart_kind")
    kind = kinds.pop() if kinds else suite
    metric = METRIC[kind]
    names = list(dict.fromkeys(n for r in rows for n in r["backends"]))  # every backend, first-seen order
    data = {n: [(r["backends"].get(n) or {}).get(metric) for r in rows] for n in names}
    return [_label(kind, r) for r in rows], {n: v for n, v in data.items() if any(x is not None for x in v)}


def write_charts(results: dict, directory: str) -> list[str]:
    """Write <directory>/<suite>.png for every suite in `results` (and <suite>-gemm.png for a suite's GEMM rows);
    returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    paths = []
    for suite, suite_rows in results.items():
        if suite not in METRIC or not suite_rows:
            continue
        by_kind: dict[str, list] = {}
        for r in suite_rows:
            by_kind.setdefault(chart_kind(suite, r), []).append(r)
        for kind, rows in by_kind.items():
            name = suite if kind == suite else f"{suite}-{kind}"
            labels, data = series(suite, rows)
            fig, ax = plt.subplots(figsize=(max(8, 0.5 * len(labels) * max(len(data), 1)), 4.5))
            width = 0.8 / max(len(data), 1)
            for i, (backend, values) in enumerate(data.items()):
                xs = [j + i * width for j in range(len(labels))]
                ax.bar(xs, [v or 0 for v in values], width, label=backend)
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))], labels, rotation=60, ha="right",
                          fontsize=7)
            ax.set_ylabel(METRIC[kind])
            ax.set_title(f"tileflash {name} vs peers")
            ax.legend(fontsize=7)
            fig.tight_layout()
            path = os.path.join(directory, f"{name}.png")
            fig.savefig(path, dpi=120)
            plt.close(fig)
            paths.append(path)
    return paths
