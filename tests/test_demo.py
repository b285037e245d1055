"""``python -m mixedopt``, the side-by-side demo."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import mixedopt.__main__ as demo
from mixedopt.__main__ import WARMUP_STEPS, main, make_parser, time_steps

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--batch-size", "1", "--image-size", "1", "--channels", "1"]  # the smallest accepted
SMALL = ["--steps", "3", "--batch-size", "4", "--image-size", "8", "--channels", "8"]

# A sitecustomize that makes numpy missing, as in a fresh venv where only torch is installed:
# the path finder no longer finds it, so ``import numpy`` raises ModuleNotFoundError and
# ``importlib.util.find_spec("numpy")`` returns None (torch asks both).
NO_NUMPY = textwrap.dedent(
    """
    import importlib.machinery
    import sys


    class _PathFinderWithoutNumpy(importlib.machinery.PathFinder):
        @classmethod
        def find_spec(cls, name, path=None, target=None):
            if name.partition(".")[0] == "numpy":
                return None
            return super().find_spec(name, path, target)


    sys.meta_path[:] = [
        _PathFinderWithoutNumpy if finder is importlib.machinery.PathFinder else finder
        for finder in sys.meta_path
    ]
    """
)
NUMPY_WARNING = "Failed to initialize NumPy"


def _without_numpy(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "sitecustomize.py").write_text(NO_NUMPY)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT)])
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_demo_prints_the_side_by_side_table(capsys):
    assert main([*SMALL, "--timed-steps", "5"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"gradient dtype\s+torch.float32\s+torch.float16", out)
    assert re.search(r"optimizer state dtype\s+torch.float32\s+torch.float32", out)
    stock, mixed = map(
        lambda s: int(s.replace(",", "")),
        re.search(r"bytes held by gradients\s+([\d,]+)\s+([\d,]+)", out).groups(),
    )
    assert stock == 2 * mixed
    assert len(re.findall(r"loss at step \d+", out)) == 3
    difference = float(re.search(r"largest weight difference after 3 steps: (\S+)", out)[1])
    assert difference < 1e-4
    stock_ms, mixed_ms = map(
        float, re.search(r"median step time \(ms\)\s+(\S+)\s+(\S+)", out).groups()
    )
    assert stock_ms > 0 and mixed_ms > 0


def test_demo_says_how_the_step_time_is_measured(capsys):
    # The steady state: a number of timed steps of its own, after the training and a warm-up.
    assert main([*SMALL, "--timed-steps", "7"]) == 0
    out = capsys.readouterr().out
    assert (
        f"step time: median of 7 timed steps of each optimizer after the training and "
        f"{WARMUP_STEPS} warm-up steps (step() alone, on the last batch's gradients, the two "
        f"optimizers taking turns)"
    ) in out
    assert WARMUP_STEPS >= 10
    assert make_parser().parse_args([]).timed_steps >= 100


def test_demo_compares_the_weights_before_the_timed_steps(monkeypatch, capsys):
    # Timed steps that move mixedopt's weights far: the difference printed is still the one
    # after the training steps, and the step times printed are those of the timed steps.
    def moving_time_steps(optimizers, timed, device):
        assert timed == 4
        for group in optimizers[1].param_groups:
            for p in group["params"]:
                p.data.add_(1.0)
        return [1.25, 2.5]

    monkeypatch.setattr(demo, "time_steps", moving_time_steps)
    assert main([*SMALL, "--timed-steps", "4"]) == 0
    out = capsys.readouterr().out
    assert float(re.search(r"largest weight difference after 3 steps: (\S+)", out)[1]) < 1e-4
    assert re.search(r"median step time \(ms\)\s+1\.250\s+2\.500\n", out)


def test_timed_steps_take_turns_after_the_warm_up():
    calls = []

    class Stepping:
        def __init__(self, name):
            self.name = name

        def step(self):
            calls.append(self.name)

    medians = time_steps([Stepping("a"), Stepping("b")], 3, torch.device("cpu"))
    assert len(medians) == 2 and all(ms >= 0 for ms in medians)
    assert calls[: 2 * WARMUP_STEPS] == ["a", "b"] * WARMUP_STEPS
    assert calls[2 * WARMUP_STEPS :] == ["a", "b", "b", "a", "a", "b"]


def test_demo_without_numpy_shows_no_numpy_warning(tmp_path):
    # The set-up reproduces the problem: torch's own import warns when numpy is missing.
    bare = _without_numpy(tmp_path, "-c", "import torch")
    assert bare.returncode == 0, bare.stderr[-3000:]
    assert NUMPY_WARNING in bare.stderr

    run = _without_numpy(
        tmp_path, "-m", "mixedopt", "--steps", "1", "--timed-steps", "2", "--device", "cpu", *TINY
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "largest weight difference after 1 step:" in run.stdout
    assert NUMPY_WARNING not in run.stderr


def test_demo_says_step_not_steps_after_one_step(capsys):
    assert main(["--steps", "1", "--timed-steps", "1", *TINY]) == 0
    out = capsys.readouterr().out
    assert "1 steps" not in out
    assert "CosineAnnealingLR, 1 step, batch" in out
    assert "largest weight difference after 1 step:" in out
    assert "median of 1 timed step of each optimizer" in out


def test_every_demo_option_has_help_text():
    options = [a for a in make_parser()._actions if a.option_strings and a.dest != "help"]
    assert {a.dest for a in options} >= {
        "steps",
        "timed_steps",
        "batch_size",
        "image_size",
        "lr",
        "seed",
    }
    for action in options:
        assert action.help and action.help.strip(), action.option_strings


def test_demo_rejects_an_unknown_device_naming_those_it_accepts(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--device", "tpu"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --device" in err and "'tpu'" in err
    assert "'cpu'" in err and "'cuda'" in err
    assert "Traceback" not in err


def test_demo_says_when_cuda_is_asked_for_but_not_available(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        main(["--device", "cuda"])
    assert exit_info.value.code == 2
    assert "CUDA is not available" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["--steps", "0"],
        ["--steps", "1.5"],
        ["--timed-steps", "0"],
        ["--timed-steps", "2.5"],
        ["--batch-size", "0"],
        ["--image-size", "-1"],
        ["--channels", "0"],
        ["--lr", "0"],
        ["--lr", "-0.1"],
        ["--lr", "nan"],
        ["--lr", "inf"],
        ["--seed", "-1"],
        ["--seed", str(2**64)],
    ],
)
def test_demo_rejects_nonsense_values_with_an_argparse_error(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"error: argument {argv[0]}:" in err
