"""What ``python -m mixedopt.bench`` prints: its tables, and what the numbers were measured on."""

from __future__ import annotations

import os
import platform
from typing import Any

import torch

import mixedopt

from .setup import VARIANTS, Row


def format_iteration(results: list[dict[str, Any]]) -> str:
    """The iteration benchmark as a markdown table."""
    lines = [
        "| optimizer | median iteration (ms) | vs torch AdamW foreach | page faults |",
        "|---|---:|---:|---:|",
    ]
    for r in results:
        faults = _fmt(r.get("page_faults"), ".0f")
        lines.append(f"| {r['variant']} | {r['median_ms']:.2f} | {r['ratio']:.2f}x | {faults} |")
    return "\n".join(lines)


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _table_row(row: Row) -> list[str]:
    label = VARIANTS[row.variant]
    if not row.available:
        return [row.optimizer, label, *["–"] * 7, f"unavailable: {row.reason}"]
    first = _fmt(row.first_step_ms, ".1f")
    if row.compile_step == 1:
        first += "; compiles"
    elif row.first_step_compile_ms is not None:
        first += f"; compile {row.first_step_compile_ms:.0f}"
    if row.peak_extra_bytes is not None:
        peak = f"{row.peak_extra_bytes / 2**20:.1f}"
    elif row.peak_extra_upper_bound is not None:
        peak = f"<= {row.peak_extra_upper_bound / 2**20:.1f}"
    else:
        peak = "–"
    ratio = "–" if row.ratio_to_foreach is None else f"{row.ratio_to_foreach:.2f}x"
    fraction = "–" if row.stream_fraction is None else f"{100 * row.stream_fraction:.0f}%"
    return [
        row.optimizer,
        label,
        _fmt(row.median_ms, ".2f"),
        ratio,
        first,
        _fmt(row.persistent_bytes_per_param, ".2f"),
        peak,
        _fmt(row.achieved_gbps, ".2f"),
        fraction,
        _note(row),
    ]


def _note(row: Row) -> str:
    notes = [row.peak_error] if row.peak_error else []
    notes += [f"warning: {text}" for text in row.warnings]
    # The step that compiled has its own column.
    compiling = None if row.compile_step is None else row.compile_step - 2  # in warmup_ms
    others = [i for i in range(len(row.warmup_ms)) if i != compiling]
    if others and row.first_step_ms is not None and row.median_ms is not None:
        slowest = max(others, key=row.warmup_ms.__getitem__)
        ms = row.warmup_ms[slowest]
        # A warm-up step far slower than the first and the median: a (re)compilation, say.
        if ms > row.first_step_ms and ms > 5 * row.median_ms and ms > row.median_ms + 20:
            notes.append(f"warm-up step {slowest + 2} took {ms:.1f} ms")
    return "; ".join(notes)


def format_table(rows: list[Row]) -> str:
    """The rows as an aligned markdown table."""
    header = [
        "optimizer",
        "variant",
        "median step (ms)",
        "vs foreach",
        "first step (ms)",
        "bytes/param",
        "peak extra (MiB)",
        "GB/s",
        "% of stream",
        "note",
    ]
    right = [False, False, True, True, True, True, True, True, True, False]
    body = [_table_row(row) for row in rows]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]

    def render(cells: list[str]) -> str:
        padded = [
            cell.rjust(w) if r else cell.ljust(w)
            for cell, w, r in zip(cells, widths, right, strict=True)
        ]
        return "| " + " | ".join(padded) + " |"

    rule = (
        "|"
        + "|".join(
            ("-" * (w + 1) + ":") if r else "-" * (w + 2)
            for w, r in zip(widths, right, strict=True)
        )
        + "|"
    )
    return "\n".join([render(header), rule, *(render(cells) for cells in body)])


def machine_info(device: torch.device, stream: dict[str, float], mib: int) -> dict[str, Any]:
    """What the numbers were measured on."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as cpuinfo:
                for line in cpuinfo:
                    if line.startswith("model name"):
                        name = line.partition(":")[2].strip()
                        break
        except OSError:
            pass
    return {
        "torch_version": torch.__version__,
        "mixedopt_version": mixedopt.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        "device_name": name,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "stream_bandwidth_gbps": stream["inplace"] / 1e9,
        "stream_kernel": f"x.add_(1) on {mib} MiB float32, 2 x nbytes / median time",
        "stream_add_out_gbps": stream["out"] / 1e9,
        "stream_mib": mib,
    }
