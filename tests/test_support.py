"""What mixedopt needs of torch, and the versions it claims (docs/support.md)."""

import re
import tomllib
from pathlib import Path

import pytest
import torch

from mixedopt import _support

ROOT = Path(__file__).resolve().parent.parent


def test_this_torch_has_everything_mixedopt_needs():
    assert _support.missing() == []


def test_a_missing_private_function_is_found_missing():
    needed = {"torch._C._no_such_function": "nothing", "torch._foreach_copy_": "copies"}
    assert _support.missing(needed) == ["torch._C._no_such_function (nothing)"]


def test_a_missing_tensor_attribute_is_found_missing():
    assert _support.missing({"torch.Tensor.no_such_attribute": "x"}) != []
    assert _support.missing({"torch.Tensor.grad_dtype": "x"}) == []


def test_a_missing_submodule_is_found_missing():
    assert _support.missing({"torch.optim.no_such_module.f": "x"}) != []


def test_import_fails_naming_what_this_torch_lacks(monkeypatch):
    monkeypatch.setitem(_support.NEEDED, "torch._C._no_such_function", "what it is for")
    with pytest.raises(ImportError) as raised:
        _support.check_torch()
    message = str(raised.value)
    assert "torch._C._no_such_function (what it is for)" in message
    assert torch.__version__ in message
    assert f"pip install torch=={_support.TESTED_TORCH}" in message


def test_the_declared_torch_lower_bound_is_the_tested_release():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    (torch_requirement,) = [r for r in project["dependencies"] if r.startswith("torch")]
    major_minor = ".".join(_support.TESTED_TORCH.split(".")[:2])
    assert torch_requirement == f"torch>={major_minor}"


def test_ci_installs_the_tested_release():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert re.findall(r"pip install torch==(\S+)", ci) == [_support.TESTED_TORCH]


def test_the_support_page_names_the_tested_release():
    page = (ROOT / "docs" / "support.md").read_text(encoding="utf-8")
    assert f"torch {_support.TESTED_TORCH}" in page
