"""scripts/compare_alternatives.py on a tiny task: its rows say what docs/alternatives.md reads."""

from __future__ import annotations

import math
import runpy
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "compare_alternatives.py"
TINY = [
    *("--steps", "4", "--warmup", "1", "--width", "64", "--depth", "3"),
    *("--features", "16", "--batch", "8", "--batches", "2"),
]
IN_BACKWARD = ["PyTorch optimizer in backward", "mixedopt step_in_backward()"]


@pytest.fixture(scope="module")
def script() -> dict[str, Any]:
    return runpy.run_path(str(SCRIPT), run_name="compare_alternatives")


def test_rows(script: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    # Optional packages that are installed would compile for a minute (torchao): left out here.
    missing = [v for v in script["VARIANTS"] if v.needs is not None and not v.available()]
    names = [v.name for v in script["VARIANTS"] if v.needs is None] + [v.name for v in missing]
    rows = {
        r.name: r for r in script["main"]([*TINY, "--no-memory", "--variants", ",".join(names)])
    }
    assert set(rows) == set(names)
    assert "| variant |" in capsys.readouterr().out

    assert rows["torch.optim"].weight_error == 0
    for v in missing:
        assert rows[v.name].status == script["NOT_INSTALLED"]
    # What stock PyTorch does with float16 .grad (AdamW's lerp, GradScaler's unscale_) fails.
    assert rows["torch.optim grad_dtype=float16"].status.startswith("fails: RuntimeError")
    refused = rows["torch.optim grad_dtype=float16 + GradScaler"].status
    assert "Attempting to unscale FP16 gradients" in refused

    ran = [r for r in rows.values() if r.status == "ok"]
    assert len(ran) == len(names) - len(missing) - 2
    for row in ran:
        assert math.isfinite(row.final_loss), row.name
        assert math.isfinite(row.iteration_ratio), row.name
    # Under autocast the weight gradients are float16 numbers: mixedopt stores them exactly.
    for name in ["mixedopt.AdamW", *IN_BACKWARD]:
        assert rows[name].weight_error < 1e-6, name
    for name in IN_BACKWARD:
        assert rows[name].step_ratio is None  # no step() after backward


def test_small_gradients(script: dict[str, Any]) -> None:
    # float32 forward, loss x 1e-4: gradients below float16's normal range. Stored as they are
    # (grad_dtype=float16) they lose bits; with mixedopt's per-tensor scale they do not.
    upcast = "torch.optim grad_dtype=float16 + upcast"
    argv = [*TINY, "--no-memory", "--autocast", "none", "--loss-factor", "1e-4"]
    rows = {r.name: r for r in script["main"]([*argv, "--variants", f"mixedopt.AdamW,{upcast}"])}
    assert rows[upcast].weight_error > 1e-2
    assert rows["mixedopt.AdamW"].weight_error < 1e-3


@pytest.mark.slow  # a child process per variant for the bytes
def test_bytes_held(script: dict[str, Any]) -> None:
    names = ["mixedopt.AdamW", "torch.optim grad_dtype=float16 + upcast", *IN_BACKWARD]
    rows = {r.name: r for r in script["main"]([*TINY, "--variants", ",".join(names)])}
    reference = rows["torch.optim"].held
    assert reference["weights"] == 4 and reference["grads"] == 4
    assert reference["state"] == pytest.approx(8, abs=0.01)

    mixed = rows["mixedopt.AdamW"].held
    assert mixed["grads"] == pytest.approx(2, abs=0.05)  # float16, padded rows included

    def per_param(held: dict[str, float]) -> float:
        return held["weights"] + held["grads"] + held["state"]

    assert per_param(reference) - per_param(mixed) == pytest.approx(2, abs=0.05)
    assert rows["torch.optim grad_dtype=float16 + upcast"].held["grads"] == 2
    for name in IN_BACKWARD:
        assert rows[name].held["grads"] == 0, name
        assert rows[name].held["state"] == pytest.approx(8, abs=0.01), name
