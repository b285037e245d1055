"""mixedopt.autocast: torch.autocast's gradients without saving cast weights for backward."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import mixedopt
from mixedopt import _autocast


def model():
    torch.manual_seed(0)
    embedding = nn.Embedding(10, 16)
    head = nn.Linear(16, 10, bias=False)
    head.weight = embedding.weight  # tied: one weight used twice
    return nn.ModuleDict(
        {
            "embedding": embedding,
            "conv": nn.Conv1d(16, 16, 3, padding=1),
            "mlp": nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)),
            "head": head,
        }
    )


def loss_of(net, tokens):
    x = net["embedding"](tokens)  # (batch, length, 16)
    x = net["conv"](x.transpose(1, 2)).transpose(1, 2)
    return net["head"](net["mlp"](x)).float().square().mean()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gradients_equal_those_of_torch_autocast(dtype):
    net, twin = model(), model()
    tokens = torch.randint(0, 10, (4, 7))
    with mixedopt.autocast("cpu", dtype=dtype):
        loss = loss_of(net, tokens)
    loss.backward()
    with torch.autocast("cpu", dtype=dtype):
        reference = loss_of(twin, tokens)
    reference.backward()
    assert torch.equal(loss, reference)
    for p, q in zip(net.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def two_linears():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))


def test_a_weight_changed_between_forward_and_backward_raises():
    net = two_linears()  # the second layer's weight is saved: the first layer needs its input
    with mixedopt.autocast("cpu", dtype=torch.float16):
        loss = net(torch.randn(2, 8)).float().sum()
    with torch.no_grad():
        net[2].weight.add_(1.0)
    with pytest.raises(RuntimeError, match="changed in place between the forward and the"):
        loss.backward()


def recorded(monkeypatch, owner, name, record):
    """Wrap ``owner.name`` so that each call appends ``record(arguments, result)`` to a list.

    Returns the list. A staticmethod stays one.
    """
    found = []
    original = inspect.getattr_static(owner, name)
    static = isinstance(original, staticmethod)
    function = original.__func__ if static else original

    def recording(*arguments):
        result = function(*arguments)
        found.append(record(arguments, result))
        return result

    monkeypatch.setattr(owner, name, staticmethod(recording) if static else recording)
    return found


@pytest.fixture
def packed(monkeypatch):
    """What mixedopt.autocast saves for backward, in order."""
    return recorded(monkeypatch, _autocast._Region, "pack", lambda _, result: result)


def test_casts_of_weights_are_saved_as_recipes_and_other_tensors_as_they_are(packed):
    net = two_linears()
    with mixedopt.autocast("cpu", dtype=torch.float16):
        net(torch.randn(2, 8)).float().sum().backward()
    recasts = [p for p in packed if isinstance(p, _autocast._Recast)]
    assert [r.leaf for r in recasts] == [net[2].weight]
    tensors = [p for p in packed if torch.is_tensor(p)]
    assert tensors  # activations are saved as usual
    for t in tensors:
        base = t._base if t._base is not None else t
        assert type(base.grad_fn).__name__ != "ToCopyBackward0"


@pytest.fixture
def handed_over(monkeypatch):
    """The leaves whose casts mixedopt.autocast hands to the gradient storage, in order."""
    return recorded(monkeypatch, _autocast, "_hand_over", lambda arguments, _: arguments[1])


def test_the_cast_of_a_layer_over_data_is_found_though_not_saved(packed, handed_over):
    net = two_linears()
    with mixedopt.autocast("cpu", dtype=torch.float16):
        net(torch.randn(2, 8)).float().sum().backward()
    recasts = [p.leaf for p in packed if isinstance(p, _autocast._Recast)]
    assert not any(leaf is net[0].weight for leaf in recasts)  # its product saves its input
    assert any(leaf is net[0].weight for leaf in handed_over)
    assert any(leaf is net[2].weight for leaf in handed_over)


@pytest.fixture
def searched(monkeypatch):
    """How many nodes each search of mixedopt.autocast ran through, in order."""
    return recorded(monkeypatch, _autocast._Region, "_search", lambda _, result: result)


def test_a_search_runs_back_only_through_the_nodes_made_since_the_last_saved_tensor(searched):
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(20)])
    x = torch.randn(2, 8, requires_grad=True)  # every product saves its weight's cast
    mask = torch.rand(2, 8)  # needs no gradient: saving it arms a search
    with mixedopt.autocast("cpu", dtype=torch.float16):
        (net(x) * mask).tanh().float().sum().backward()
    assert len(searched) == 1
    assert 0 < searched[0] <= 3  # the product with the mask and the tanh, of 100 nodes and more


def test_a_16_bit_weight_cast_to_float32_is_recast_with_the_gradients_of_torch_autocast(packed):
    """Autocast runs some operations in float32 (``cdist`` here): it casts 16-bit weights up."""
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(4, 8, dtype=torch.bfloat16))
    twin = nn.Parameter(weight.detach().clone())
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    with mixedopt.autocast("cpu", dtype=torch.bfloat16):
        loss = torch.cdist(x, weight).square().sum()
    loss.backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.cdist(x, twin).square().sum().backward()
    recasts = [p for p in packed if isinstance(p, _autocast._Recast)]
    assert [r.leaf for r in recasts] == [weight]
    assert recasts[0].tensor().dtype == torch.float32
    assert torch.equal(weight.grad, twin.grad)


def test_step_in_backward_under_it_gives_the_weights_of_backward_then_step():
    net, twin = model(), model()
    opt, ref = mixedopt.Adam(net.parameters()), mixedopt.Adam(twin.parameters())
    for _ in range(3):
        tokens = torch.randint(0, 10, (4, 7))
        with mixedopt.autocast("cpu", dtype=torch.float16):
            loss = loss_of(net, tokens)
        with opt.step_in_backward():
            loss.backward()
        with torch.autocast("cpu", dtype=torch.float16):
            loss_of(twin, tokens).backward()
        ref.step()
        ref.zero_grad()
    for p, q in zip(net.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.slow  # torch.compile
def test_a_compiled_model_gets_the_gradients_of_torch_autocast():
    net, twin = two_linears(), two_linears()
    x = torch.randn(4, 8)
    with mixedopt.autocast("cpu", dtype=torch.float16):
        loss = torch.compile(net)(x).float().square().mean()
    loss.backward()
    with torch.autocast("cpu", dtype=torch.float16):
        torch.compile(twin)(x).float().square().mean().backward()
    for p, q in zip(net.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
