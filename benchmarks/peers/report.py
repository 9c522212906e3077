"""The table (markdown), the "Peer comparison" section of benchmarks/RESULTS.md and the two
plots, all from the results dict that run.py saves in benchmarks/out/peers/results.json.

Rerun only this step: ``python benchmarks/peers/report.py`` (reads that JSON)."""

from __future__ import annotations

import json
import os
import statistics
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)
RESULTS_MD = os.path.join(BENCH, "RESULTS.md")
BEGIN, END = "<!-- peers:begin (written by benchmarks/peers/run.py) -->", "<!-- peers:end -->"
SYSTEM_LABELS = {"streamcache": "streamcache", "mosaic": "Mosaic Streaming",
                 "litdata": "LitData", "webdataset": "WebDataset",
                 "torchdata": "torchdata StatefulDataLoader", "dataloader": "torch DataLoader",
                 "raw-gather": "raw page-cache gather"}
PLOT_LABELS = {"mosaic": "Mosaic", "torchdata": "torchdata\nStateful",
               "dataloader": "torch\nDataLoader", "raw-gather": "raw\ngather"}


def _runs(results: dict[str, Any], data: str, case: str, system: str) -> list[dict[str, Any]]:
    return [r for r in results["runs"]
            if r["data"] == data and r["case"] == case and r["system"] == system]


def median_of(results: dict[str, Any], data: str, case: str, system: str, key: str,
              ) -> float | str:
    """The median of ``key`` over the repeats, or why there is none ("cannot: ...")."""
    runs = _runs(results, data, case, system)
    if not runs:
        return "not run"
    if "cannot" in runs[0]:
        return "cannot"
    values = [r[key] for r in runs if key in r]
    if not values:
        errors = [r["error"] for r in runs if "error" in r]
        return "error" if errors else "n/a"
    return statistics.median(values)


def _fmt(value: float | str, digits: str = ",.0f") -> str:
    return value if isinstance(value, str) else format(value, digits)


def _exact(result: dict[str, Any] | None) -> str:
    if not result:
        return "not run"
    if "cannot" in result:
        return "cannot"
    if "error" in result:
        return "error"
    text = f"{result['duplicates']} / {result['skipped']}"
    if result.get("note"):
        text += " (not supported, see below)"
    if result.get("uninterrupted_duplicates") or result.get("uninterrupted_skipped"):
        text += (f" (uninterrupted {result['uninterrupted_duplicates']} / "
                 f"{result['uninterrupted_skipped']})")
    return text


def _resume_exact(results: dict[str, Any], data: str, system: str) -> dict[str, Any] | None:
    runs = _runs(results, data, "resume", system)
    for run in runs:
        if "exact" in run or "cannot" in run or "error" in run:
            return run.get("exact", run)
    return None


def systems(results: dict[str, Any]) -> list[str]:
    seen: list[str] = []
    for run in results["runs"]:
        if run["system"] not in seen:
            seen.append(run["system"])
    return seen


def table(results: dict[str, Any]) -> str:
    head = ("| data | system | warm w0 samples/s | warm w2 samples/s | cold S3 w2 samples/s "
            "| 1st batch s (w2) | 1st batch after 50% resume s | mid-epoch resume dup / skip "
            "| elastic 2→4 dup / skip |")
    lines = [head, "|" + "---|" * 9]
    for data in results["datasets"]:
        for system in systems(results):
            elastic = results["elastic"].get(f"{system}/{data}")
            cells = [
                _fmt(median_of(results, data, "warm-w0", system, "samples_per_s")),
                _fmt(median_of(results, data, "warm-w2", system, "samples_per_s")),
                _fmt(median_of(results, data, "cold-w2", system, "samples_per_s")),
                _fmt(median_of(results, data, "warm-w2", system, "first_batch_s"), ".3f"),
                _fmt(median_of(results, data, "resume", system, "resume_first_batch_s"), ".3f"),
                _exact(_resume_exact(results, data, system)),
                _exact(elastic) if elastic is not None else "(tokens only)",
            ]
            lines.append(f"| {data} | {SYSTEM_LABELS.get(system, system)} | "
                         + " | ".join(cells) + " |")
    return "\n".join(lines)


def reasons(results: dict[str, Any]) -> str:
    """Why a cell says cannot or error (one line per system and reason)."""
    out: dict[str, set[str]] = {}
    for run in results["runs"]:
        for key in ("cannot", "error"):
            if key in run:
                out.setdefault(run["system"], set()).add(f"{run['case']}: {key}: {run[key]}")
    for name, run in results["elastic"].items():
        for key in ("cannot", "error", "note"):
            if key in run:
                out.setdefault(name.split("/")[0], set()).add(f"elastic: {key}: {run[key]}")
    return "\n".join(f"- {SYSTEM_LABELS.get(s, s)}: " + "; ".join(sorted(r))
                     for s, r in out.items())


def section(results: dict[str, Any]) -> str:
    v = results["versions"]
    sets = ", ".join(f"{d} {info['samples']:,} samples x {info['sample_bytes']:,} B "
                     f"(batch {info['batch']})" for d, info in results["datasets"].items())
    load = results["load_before"], results["load_after"]
    return "\n".join([
        BEGIN,
        "## Peer comparison",
        "",
        f"Measured {results['date']} on a {results['cpus']}-core machine (load average "
        f"{load[0][0]:.1f} before, {load[1][0]:.1f} after; "
        f"{results.get('machine') or 'what else ran was not recorded'}; medians of the "
        "repeats, cases interleaved).",
        f"Command: `/tmp/peers-venv/bin/{results['command']}` ({results['repeats']} repeats, "
        f"{results['wall_s'] / 60:.1f} min); setup in `benchmarks/peers/README.md`.",
        f"streamcache commit {v.get('streamcache commit')}; torch {v['torch']}, "
        f"mosaicml-streaming {v['mosaicml-streaming']}, litdata {v['litdata']}, "
        f"webdataset {v['webdataset']}, torchdata {v['torchdata']}, numpy {v['numpy']}, "
        f"pyarrow {v['pyarrow']}, moto {v['moto']} (loopback S3).",
        f"Data: {sets}; every system's native format, shards of about 16 MB, uncompressed; "
        "shuffled epoch, one process (ranks simulated by processes for the elastic case).",
        "",
        table(results),
        "",
        "Rates are steady state (first batch to end of epoch). cold: from the loopback S3 server "
        "into an empty cache (WebDataset streams tars with curl and caches nothing). "
        "dup / skip: sample ids delivered twice / never over the interrupted epoch "
        "(2 workers; elastic: 2 ranks stop at 50%, 4 ranks resume from rank 0's state, "
        "global batch fixed, 0 workers). WebDataset shuffles shards plus a 1,000-sample "
        "buffer; the others shuffle globally.",
        "",
        "Why a case did not run (or what a peer lacks):",
        "",
        reasons(results) or "- every case ran",
        "",
        "![throughput](peers_throughput.png) ![resume](peers_resume.png)",
        END,
    ])


def write_results_md(results: dict[str, Any]) -> None:
    text = ""
    if os.path.exists(RESULTS_MD):
        with open(RESULTS_MD) as f:
            text = f.read()
    block = section(results)
    if BEGIN in text and END in text:
        before, rest = text.split(BEGIN, 1)
        text = before + block + rest.split(END, 1)[1]
    else:
        head = text.rstrip() + "\n\n" if text.strip() else "# Benchmark results\n\n"
        text = head + block + "\n"
    with open(RESULTS_MD, "w") as f:
        f.write(text)


def plots(results: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = systems(results)
    labels = [PLOT_LABELS.get(s, s) for s in names]
    datas = list(results["datasets"])
    plot_groups(plt, results, names, labels, datas,
                [("warm-w0", "samples_per_s", "warm w0"), ("warm-w2", "samples_per_s", "warm w2"),
                 ("cold-w2", "samples_per_s", "cold S3 w2")],
                "samples/s (log)", "Throughput, shuffled epoch (median of repeats)",
                os.path.join(BENCH, "peers_throughput.png"))
    plot_groups(plt, results, names, labels, datas,
                [("warm-w2", "first_batch_s", "1st batch, fresh"),
                 ("resume", "resume_first_batch_s", "1st batch after 50% resume")],
                "seconds (log)", "Time to first batch (2 workers, warm)",
                os.path.join(BENCH, "peers_resume.png"))


def plot_groups(plt: Any, results: dict[str, Any], names: list[str], labels: list[str],
                datas: list[str], series: list[tuple[str, str, str]], ylabel: str, title: str,
                path: str) -> None:
    fig, axes = plt.subplots(1, len(datas), figsize=(6 * len(datas), 4), dpi=80)
    width = 0.8 / len(series)
    for ax, data in zip(axes, datas, strict=True):
        for k, (case, key, label) in enumerate(series):
            values = [median_of(results, data, case, s, key) for s in names]
            xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(names))]
            heights = [v if isinstance(v, float) and v > 0 else 0 for v in values]
            ax.bar(xs, heights, width, label=label)
            for x, v in zip(xs, values, strict=True):
                if isinstance(v, str):
                    ax.text(x, 0.02, "n/a", rotation=90, ha="center", va="bottom", fontsize=6,
                            transform=ax.get_xaxis_transform())
        ax.set_yscale("log")
        ax.set_xticks(range(len(names)), labels, fontsize=7)
        ax.set_title(f"{data}", fontsize=9)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=len(series),
                  frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_report(results: dict[str, Any]) -> str:
    write_results_md(results)
    plots(results)
    return table(results) + "\n\n" + reasons(results)


if __name__ == "__main__":
    with open(os.path.join(BENCH, "out", "peers", "results.json")) as f:
        print(write_report(json.load(f)))
    sys.exit(0)
