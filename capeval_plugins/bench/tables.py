"""The markdown tables ``capeval bench`` prints."""
from __future__ import annotations

import math
from typing import Any, Sequence

GREEK = {"kendall_tau_b": "Kendall τb", "kendall_tau_c": "Kendall τc", "pearson": "Pearson", "spearman": "Spearman",
         "accuracy": "accuracy"}
STATS = ("kendall_tau_b", "kendall_tau_c", "pearson", "spearman")


def label(stat: str) -> str:
    """``pearson:paragraph`` -> ``Pearson (paragraph)``."""
    base, _, column = stat.partition(":")
    return GREEK.get(base, base) + (f" ({column})" if column else "")


def number(value: Any, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.{digits}f}"


def ci(pair: Sequence[float] | None) -> str:
    return "–" if not pair else f"[{number(pair[0])}, {number(pair[1])}]"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return out + ["| " + " | ".join(row) + " |" for row in rows]


def report_markdown(report) -> str:
    doc = report.to_dict()
    bench, protocol = report.benchmark, report.benchmark.protocol
    size = f"{doc['data']['rows']:,} rows" + (f", {doc['data']['pairs']:,} pairs" if "pairs" in doc["data"] else "")
    lines = [f"**{bench.title}** (`{bench.name}`), {size}; {protocol.description}.", ""]
    if "labels" in doc["data"]:
        lab = doc["data"]["labels"]
        lines[-1:-1] = ["", f"Human judgments from `{lab['path']}` where it names the row: {lab['matched']:,} matched, "
                        f"{lab['changed']:,} changed, {lab['unmatched']:,} as in the benchmark file."]
    results = doc["results"]
    if protocol.kind == "correlation":
        stat = protocol.primary
        first = next(iter(results.values()), {})
        shown = protocol.table_stats or STATS
        columns = [k for k in first if k.split(":")[0] in shown]
        columns.sort(key=lambda k: ":" in k)  # a mean over human columns before the columns themselves
        header = ["metric", "n", *(label(c) for c in columns), f"95% CI ({label(stat)})", "time (s)"]
        rows = [[name, f"{r['n']:,}", *(number(r.get(c)) for c in columns), ci(r.get("ci95", {}).get(stat)), _time(r)]
                for name, r in results.items()]
        systems = {name: r["system"] for name, r in results.items() if "system" in r}
        if systems:
            sys_cols = [k for k in next(iter(systems.values())) if k.split(":")[0] in shown]
            lines += table(header, rows) + ["", f"System level ({next(iter(systems.values()))['n']} systems: mean "
                                            "metric score per system against mean human score):", ""]
            header, rows = ["metric", *(label(c) for c in sys_cols)], [
                [name, *(number(s.get(c)) for c in sys_cols)] for name, s in systems.items()]
    elif report.data.__class__.__name__ == "Pairs" and report.data.graded is not None:
        stat = protocol.primary
        columns = [k for k in next(iter(results.values()), {})
                   if k.split(":")[0] in ("accuracy", "spearman", "kendall_tau_b", "pearson") and ":" in k]
        header = ["metric", "n", *(label(c) for c in columns), f"95% CI ({label(stat)})", "time (s)"]
        rows = [[name, f"{r['n']:,}", *(number(r.get(c)) for c in columns), ci(r.get("ci95", {}).get(stat)), _time(r)]
                for name, r in results.items()]
    else:
        cats = list(next(iter(results.values()))["categories"]) if results else []
        groups = list(next(iter(results.values())).get("groups", {})) if results else []
        overall = "overall" if protocol.pooled else "mean"
        header = ["metric", "n", *cats, *groups] + ([overall, f"95% CI ({overall})"] if protocol.mean else []) + \
            ["ties", "time (s)"]
        rows = []
        for name, r in results.items():
            row = [name, f"{r['n']:,}", *(number(r["categories"][c]["accuracy"]) for c in cats),
                   *(number(r["groups"][g]["accuracy"]) for g in groups)]
            if protocol.mean:
                row += [number(r.get("accuracy")), ci(r.get("ci95", {}).get("accuracy"))]
            rows.append(row + [f"{r['n_ties']:,}", _time(r)])
        models = {name: r["system"] for name, r in results.items() if "system" in r}
        if models:
            elo = "one-pass Elo" if protocol.elo == "single" else "bootstrap-Elo"
            lines += table(header, rows) + ["", f"Model level ({elo} ranking from the metric's decisions "
                                            "against the human ranking):", ""]
            header = ["metric", "models", "Spearman", "Kendall τb"]
            rows = [[name, str(m["n"]), number(m.get("spearman")), number(m.get("kendall_tau_b"))]
                    for name, m in models.items()]
    lines += table(header, rows)
    if doc["comparisons"]:
        lines += ["", "Paired bootstrap comparisons (difference = first - second):", ""]
        lines += table(["comparison", "statistic", "difference", "95% CI", "p"],
                       [[f"{c['metrics'][0]} vs {c['metrics'][1]}", c["statistic"], number(c["difference"]),
                         ci(c.get("ci95")), number(c.get("p_value"), 3)] for c in doc["comparisons"]])
    return "\n".join(lines)


def _time(result: dict) -> str:
    seconds = number(result["seconds"])
    return f"{seconds} (cached)" if result["from_cache"] and not result["computed"] else seconds
