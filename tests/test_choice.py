"""Which implementation updates a batch: ``_choice.implementation``, the one place that decides."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import mixedopt
from mixedopt._budget import CPU_SMALL, budget
from mixedopt._choice import Implementation, implementation

SMALL = budget(torch.device("cpu")).fused_small


def group(fused=None, foreach=None, lr=1e-3):
    return {"fused": fused, "foreach": foreach, "lr": lr}


def tensors(*numels):
    return [torch.zeros(n) for n in numels]


def test_a_fused_group_of_small_dense_parameters_takes_torch_fused_where_the_parent_has_it():
    chosen = implementation(group(fused=True), tensors(10, 20), torch_fused=True, compiled=True)
    assert chosen is Implementation.TORCH_FUSED


def test_a_fused_group_takes_the_compiled_kernels_for_a_parameter_above_fused_small():
    chosen = implementation(group(fused=True), tensors(SMALL + 1), torch_fused=True, compiled=True)
    assert chosen is Implementation.COMPILED


def test_a_fused_group_takes_the_compiled_kernels_where_the_parent_has_no_torch_fused():
    chosen = implementation(group(fused=True), tensors(10), torch_fused=False, compiled=True)
    assert chosen is Implementation.COMPILED


def test_a_fused_group_takes_the_compiled_kernels_for_a_parameter_with_gaps():
    with_gaps = torch.zeros(8, 8)[:, ::2]
    chosen = implementation(group(fused=True), [with_gaps], torch_fused=True, compiled=True)
    assert chosen is Implementation.COMPILED


def test_without_the_compiled_kernels_a_large_dense_parameter_takes_torch_fused():
    chosen = implementation(group(fused=True), tensors(SMALL + 1), torch_fused=True, compiled=False)
    assert chosen is Implementation.TORCH_FUSED


def test_without_either_fused_update_a_fused_group_takes_torchs_other_implementations():
    with_gaps = torch.zeros(8, 8)[:, ::2]
    chosen = implementation(group(fused=True), [with_gaps], torch_fused=True, compiled=False)
    assert chosen is Implementation.FOREACH  # small, on a CPU


@pytest.mark.parametrize(
    ("numels", "expected"),
    [((10, 20), Implementation.FOREACH), ((CPU_SMALL * 4,), Implementation.FOR_LOOP)],
    ids=["small", "large"],
)
def test_the_default_foreach_on_a_cpu_takes_foreach_for_small_tensors_only(numels, expected):
    chosen = implementation(group(), tensors(*numels), torch_fused=True, compiled=False)
    assert chosen is expected


def test_the_default_foreach_takes_foreach_for_large_tensors_where_it_makes_fewer_temporaries():
    large = tensors(CPU_SMALL * 4, CPU_SMALL * 8)
    chosen = implementation(
        group(), large, torch_fused=True, compiled=False, foreach_fewer_temporaries=True
    )
    assert chosen is Implementation.FOREACH


@pytest.mark.parametrize(
    ("name", "expected"),
    [("Adam", Implementation.FOREACH), ("AdamW", Implementation.FOREACH)]
    + [(name, Implementation.FOR_LOOP) for name in ("SGD", "RMSprop", "Adagrad")],
)
def test_adams_large_cpu_batches_take_torchs_foreach_update(name, expected):
    """Adam's for-loop divides a fresh square root into another temporary; foreach in place."""
    params = [torch.nn.Parameter(t) for t in tensors(CPU_SMALL * 4, CPU_SMALL * 8)]
    optimizer = getattr(mixedopt, name)(params, lr=1e-3)
    assert optimizer._torch_implementation(optimizer.param_groups[0], params) is expected


def test_a_tensor_learning_rate_leaves_the_choice_to_torch():
    lr = torch.tensor(1e-3)
    chosen = implementation(group(lr=lr), tensors(10), torch_fused=True, compiled=False)
    assert chosen is Implementation.TORCH_DEFAULT


@pytest.mark.parametrize(
    ("foreach", "expected"),
    [(True, Implementation.FOREACH), (False, Implementation.FOR_LOOP)],
)
def test_an_explicit_foreach_is_followed(foreach, expected):
    chosen = implementation(
        group(foreach=foreach), tensors(CPU_SMALL * 4), torch_fused=True, compiled=False
    )
    assert chosen is expected


def test_the_functional_arguments_of_each_torch_implementation():
    assert Implementation.TORCH_FUSED.functional_kwargs() == {"foreach": None, "fused": True}
    assert Implementation.FOREACH.functional_kwargs() == {"foreach": True, "fused": False}
    assert Implementation.FOR_LOOP.functional_kwargs() == {"foreach": False, "fused": False}
    assert Implementation.TORCH_DEFAULT.functional_kwargs() == {"foreach": None, "fused": False}


def is_group(node: ast.AST) -> bool:
    """A parameter group, as the library names it: ``group`` or ``self.param_groups[i]``."""
    if isinstance(node, ast.Name):
        return node.id == "group"
    return (
        isinstance(node, ast.Subscript)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "param_groups"
    )


def reads_of(key: str, tree: ast.AST) -> list[int]:
    """Lines that read ``key`` of a parameter group: ``group["key"]`` or ``group.get("key")``."""
    lines = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Subscript)
            and is_group(node.value)
            and isinstance(node.slice, ast.Constant)
            and node.slice.value == key
        ) or (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and is_group(node.func.value)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and node.args[0].value == key
        ):
            lines.append(node.lineno)
    return lines


def test_the_read_finder_finds_reads_of_a_group():
    tree = ast.parse('a = group["fused"]\nb = group.get("foreach")\nc = kwargs.get("fused")')
    assert reads_of("fused", tree) == [1]
    assert reads_of("foreach", tree) == [2]


def test_no_library_module_but_the_choice_reads_a_groups_fused_or_foreach():
    package = Path(mixedopt.__file__).parent
    found = {
        f"{path.name}:{line}"
        for path in package.glob("*.py")  # the library; the benchmarks are a subpackage
        if path.name != "_choice.py"
        for key in ("fused", "foreach")
        for line in reads_of(key, ast.parse(path.read_text()))
    }
    assert found == set()
