"""The parity tests can fail: each behaviour they guard, broken on purpose, makes them fail.

Each mutation edits a copy of the library's source (one behaviour, every code path that has
it), and ``tests/test_parity.py``'s comparisons with torch.optim run against that copy in a
child process: they must fail on an assertion. The unbroken copy must pass them, so that a
failure is the mutation's. An edit whose text is no longer in the source fails here too:
update the mutation with the code it breaks.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import mixedopt

PACKAGE = Path(mixedopt.__file__).parent
TESTS = Path(__file__).parent

# name -> [(file, text, replacement)]: every occurrence of ``text`` in ``file`` is replaced.
MUTATIONS = {
    "none": [],
    # Every storage scale doubled (and undone): only the rounding of the smallest elements
    # differs from the documented one (float16's subnormal numbers).
    "storage scale x2, decoded consistently": [
        ("_scales.py", "_TARGET_EXPONENT = 8", "_TARGET_EXPONENT = 9")
    ],
    # Every gradient stored at twice its storage scale, and decoded with the recorded one.
    "storage scale x2": [
        (
            "_bucket_store.py",
            "        stats = torch.stack([scales, amax], dim=1)\n",
            "        stored.mul_(2)\n        stats = torch.stack([scales, amax], dim=1)\n",
        ),
        (
            "_scales.py",
            "        slot.record(stored, stats, 0, stored._version)",
            "        stored.mul_(2)\n        slot.record(stored, stats, 0, stored._version)",
        ),
    ],
    "unscale skipped": [
        (
            "_reference_step.py",
            "factors = scales.reciprocal() if unscale is None else unscale / scales",
            "factors = torch.ones_like(scales) if unscale is None else unscale + 0 * scales",
        ),
        (
            "_bucket_step.py",
            "factors = unscale.to(device) / stats[:, 0].to(device)",
            "factors = unscale.to(device) + 0 * stats[:, 0].to(device)",
        ),
        ("_bucket_step.py", "divisors = stats  #", "divisors = torch.ones_like(stats)  #"),
    ],
    "unscale x2": [
        (
            "_reference_step.py",
            "factors = scales.reciprocal() if unscale is None else unscale / scales",
            "factors = 2 * (scales.reciprocal() if unscale is None else unscale / scales)",
        ),
        (
            "_bucket_step.py",
            "factors = unscale.to(device) / stats[:, 0].to(device)",
            "factors = 2 * unscale.to(device) / stats[:, 0].to(device)",
        ),
        ("_bucket_step.py", "divisors = stats  #", "divisors = stats / 2  #"),
    ],
    # A gradient added to an earlier one replaces it: a micro-batch lost.
    "micro-batch dropped": [
        (
            "_bucket_store.py",
            "torch._foreach_addcmul_([views[i] for i in added], earlier, inverse)",
            "del earlier, inverse",
        ),
        ("_scales.py", "true = torch.addcmul(true, previous, inverse)", "del inverse"),
    ],
    "inf/NaN skip ignored": [
        (
            "_scales.py",
            "return ~(bounds.amax() < math.inf)",
            "return torch.zeros((), dtype=torch.bool, device=bounds.device)",
        ),
        (
            "_reference_step.py",
            "skip = found_inf.to(device) > 0",
            "skip = found_inf.to(device) < 0",
        ),
        ("_bucket_step.py", "found_inf.to(device) > 0", "found_inf.to(device) < 0"),
    ],
    "GradScaler's scale ignored": [
        (
            f"{module}.py",
            "unscale = grad_scale.to(device=device, dtype=torch.float32).reciprocal()",
            "unscale = torch.ones((), device=device)",
        )
        for module in ("_reference_step", "_bucket_step")
    ],
    "clipping norm x2": [
        (
            "_reference_step.py",
            "clip = torch.clamp(max_grad_norm / (total + 1e-6), max=1.0)",
            "clip = torch.clamp(max_grad_norm / (2 * total + 1e-6), max=1.0)",
        )
    ],
    # One path only: each must be caught by the parity tests of that path.
    "whole buckets: unscale skipped": [
        ("_bucket_step.py", "divisors = stats  #", "divisors = torch.ones_like(stats)  #")
    ],
    "fused=True: unscale skipped": [
        ("_fused_step.py", "per_row(factors),", "per_row(torch.ones_like(factors)),"),
        ("_fused_step.py", "*tensors[:2], factors[i],", "*tensors[:2], factors[i] ** 0,"),
        (
            "_fused_step.py",
            "selected = factors.index_select(0, index)",
            "selected = torch.ones_like(factors).index_select(0, index)",
        ),
    ],
    "step_in_backward: an update lost": [
        (
            "_in_backward.py",
            "by_group[self.group_of[id(p)]].append(p)",
            "by_group[self.group_of[id(p)]].extend([p] if p is not params[0] else [])",
        )
    ],
}

# The child: import the copy (and check it is the copy), then the parity tests, stopping at
# the first failure, on the same 100 examples each time, without shrinking them.
CHILD = """
import sys
import mixedopt, pytest
assert mixedopt.__file__.startswith(sys.argv[1]), mixedopt.__file__
sys.exit(pytest.main(["-x", "-q", "-p", "no:cacheprovider", *sys.argv[2:]]))
"""


def mutant(tmp_path: Path, edits) -> Path:
    """A copy of the package with ``edits`` applied; the directory to put on the path."""
    root = tmp_path / "mutant"
    shutil.copytree(PACKAGE, root / "mixedopt", ignore=shutil.ignore_patterns("__pycache__"))
    for file, text, replacement in edits:
        path = root / "mixedopt" / file
        source = path.read_text()
        assert text in source, f"{file} no longer has {text!r}: update this mutation"
        path.write_text(source.replace(text, replacement))
    return root


@pytest.mark.parametrize("name", MUTATIONS)
def test_parity_tests_fail_on_a_broken_library(name, tmp_path):
    root = mutant(tmp_path, MUTATIONS[name])
    env = dict(os.environ, PYTHONPATH=str(root), HYPOTHESIS_PROFILE="mutations")
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(root), str(TESTS / "test_parity.py")],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,  # not the checkout, whose package would come first on the path
        timeout=1200,
    )
    output = result.stdout + result.stderr
    if name == "none":
        assert result.returncode == 0, output[-3000:]
    else:
        assert result.returncode == 1, output[-3000:]  # tests failed (not an error)
        assert re.search(r"^1 failed", output, re.MULTILINE), output[-3000:]
        assert "AssertionError" in output, output[-3000:]
