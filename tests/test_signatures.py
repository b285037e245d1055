"""Every optimizer's signature is its torch.optim parent's, plus mixedopt's own arguments."""

from __future__ import annotations

import inspect

import pytest
import torch
from helpers import EVERY_OPTIMIZER

# Keyword-only, after the parent's: mixedopt's own arguments, and ``fused`` where the parent
# has none.
OWN = {"grad_dtype": torch.float16, "max_grad_norm": None}
ADDED_FUSED = {"RMSprop"}


def parameters(cls):
    return list(inspect.signature(cls).parameters.values())


@pytest.mark.parametrize("name", EVERY_OPTIMIZER)
def test_signature_is_the_parents_in_its_order_with_its_defaults_and_kinds(name):
    mixed_cls, torch_cls = EVERY_OPTIMIZER[name]
    own = dict(OWN, **({"fused": None} if name in ADDED_FUSED else {}))
    mine = parameters(mixed_cls)
    theirs = parameters(torch_cls)
    assert [(p.name, p.kind, p.default) for p in mine[: len(theirs)]] == [
        (p.name, p.kind, p.default) for p in theirs
    ]
    extra = mine[len(theirs) :]
    assert {p.name: p.default for p in extra} == own
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in extra)


@pytest.mark.parametrize("name", EVERY_OPTIMIZER)
def test_help_shows_the_parents_arguments(name):
    text = str(inspect.signature(EVERY_OPTIMIZER[name][0]))
    assert "lr" in text and "**" not in text and "*args" not in text
