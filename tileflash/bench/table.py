"""Plain-text tables for benchmark results."""

_NUMBER = (int, float)


def format_cell(value):
    """None -> '-'; floats get 1 decimal, 2 below 10 so ratios like 0.93 stay readable."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.2f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def format_table(headers, rows, title=None):
    """An ASCII table with +---+ borders. A column is left-aligned when all its non-None
    cells are strings, right-aligned otherwise (numbers)."""
    cells = [[format_cell(v) for v in row] for row in rows]
    for row in cells:
        if len(row) != len(headers):
            raise ValueError(f"row has {len(row)} cells, expected {len(headers)}")
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    left = [
        all(isinstance(r[i], str) for r in rows if r[i] is not None) and any(r[i] is not None for r in rows)
        for i in range(len(headers))
    ]

    def line(values):
        padded = (v.ljust(w) if l else v.rjust(w) for v, w, l in zip(values, widths, left))
        return "| " + " | ".join(padded) + " |"

    rule = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    out = [title] if title else []
    out += [rule, line(headers), rule, *(line(r) for r in cells), rule]
    return "\n".join(out)
