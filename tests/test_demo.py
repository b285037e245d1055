"""``python -m mixedopt``, the side-by-side demo."""

from __future__ import annotations

import re

import pytest

from mixedopt.__main__ import main


def test_demo_prints_the_side_by_side_table(capsys):
    assert main(["--steps", "3", "--batch-size", "4", "--image-size", "8", "--channels", "8"]) == 0
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


def test_demo_rejects_zero_steps():
    with pytest.raises(SystemExit) as exit_info:
        main(["--steps", "0"])
    assert exit_info.value.code == 2
