"""Evaluation results as tables: each data set's headline numbers, the suite's aggregates, and runs side by side,
for a terminal and as Markdown."""

from __future__ import annotations

from cloob_core.config import SUITE_RESULT, TASK_RESULTS

# (result kind, scalar, column title): each data set's headline, in summaries and comparisons of runs
COLUMNS = (("zeroshot_classification", "acc1", "zero-shot acc1"), ("linear_probe", "lp_acc1", "linear-probe acc1"),
           ("zeroshot_retrieval", "text_retrieval_recall@1", "image->text R@1"),
           ("zeroshot_retrieval", "text_retrieval_recall@5", "image->text R@5"),
           ("zeroshot_retrieval", "image_retrieval_recall@1", "text->image R@1"),
           ("zeroshot_retrieval", "image_retrieval_recall@5", "text->image R@5"),
           ("diagnostics", "effective_eigenvalues_image", "effective eigenvalues (image)"))


def as_percent(key: str) -> bool:
    """Accuracies and recalls (and aggregates of them, by their names) are shown as percentages."""
    return "acc" in key or "recall" in key


def cell(key: str, value: float | None) -> str:
    if value is None:
        return "-"
    return f"{100 * value:.2f}%" if as_percent(key) else f"{value:.4g}"


def datasets_in(combined: dict[str, dict]) -> list[str]:
    """The data sets a report has results for (result names are ``<data set>_<result>``)."""
    kinds = set(TASK_RESULTS.values())
    return sorted({name[: -len(kind) - 1] for name in combined for kind in kinds if name.endswith(f"_{kind}")})


def comparison_rows(runs: dict[str, dict[str, dict]]) -> tuple[list[str], list[list[str]], dict[str, list[float]]]:
    """Runs (label -> a report's metrics.json) side by side: the header, one row per (run, data set), and the
    zero-shot and linear-probe numbers per column (in %)."""
    header = ["run", "data set", *(title for _, _, title in COLUMNS)]
    rows, numbers = [], {title: [] for _, _, title in COLUMNS[:2]}
    for label, combined in runs.items():
        for dataset in datasets_in(combined):
            cells = [label, dataset]
            for kind, key, title in COLUMNS:
                value = combined.get(f"{dataset}_{kind}", {}).get(key)
                cells.append(cell(key, value))
                if title in numbers and value is not None:
                    numbers[title].append(100 * value)
            rows.append(cells)
    return header, rows, numbers


def suite_rows(runs: dict[str, dict[str, dict]]) -> tuple[list[str], list[list[str]]]:
    """The suite's aggregates of each run: the header (run, then each aggregate) and one row per run."""
    names = list(dict.fromkeys(name for combined in runs.values() for name in combined.get(SUITE_RESULT, {})))
    rows = [[label, *(cell(name, runs[label].get(SUITE_RESULT, {}).get(name)) for name in names)]
            for label in runs if runs[label].get(SUITE_RESULT)]
    return ["run", *(f"{SUITE_RESULT}.{name}" for name in names)], rows


def _aligned(header: list[str], rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    return [indent + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
            for row in (header, *rows)]


def summary_table(combined: dict[str, dict]) -> str:
    """Each data set's headline numbers and the suite's aggregates, for a terminal."""
    header, rows, _ = comparison_rows({"": combined})
    lines = ["evaluation summary", *_aligned(header[1:], [row[1:] for row in rows])]
    suite = combined.get(SUITE_RESULT, {})
    if suite:
        lines.append(f"suite means over {len(rows)} data sets")
        lines += _aligned(["aggregate", "value"], [[f"{SUITE_RESULT}.{name}", cell(name, value)]
                                                   for name, value in suite.items()])
    return "\n".join(lines)


def markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def comparison_markdown(runs: dict[str, dict[str, dict]]) -> str:
    header, rows, _ = comparison_rows(runs)
    lines = markdown_table(header, rows)
    suite_header, suite = suite_rows(runs)
    if suite:
        lines += ["", *markdown_table(suite_header, suite)]
    return "\n".join(lines) + "\n"
