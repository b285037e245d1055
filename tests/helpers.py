"""Small models and training loops shared by the tests."""

from __future__ import annotations

import copy

import torch
from torch import nn

import mixedopt

OPTIMIZERS = {
    "RMSprop": (mixedopt.RMSprop, torch.optim.RMSprop),
    "Adam": (mixedopt.Adam, torch.optim.Adam),
    "AdamW": (mixedopt.AdamW, torch.optim.AdamW),
    "SGD": (mixedopt.SGD, torch.optim.SGD),
}


def small_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))


def twin(model: nn.Module) -> nn.Module:
    """An independent copy of ``model`` with the same weights."""
    return copy.deepcopy(model)


def autocast_backward(model: nn.Module, x: torch.Tensor, loss_scale: float = 1.0) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(x).float().square().mean() * loss_scale
    loss.backward()
    return loss.detach()


def fp32_grads(model: nn.Module, x: torch.Tensor, loss_scale: float = 1.0) -> list[torch.Tensor]:
    """The float32 gradients autograd gives for the same loss as ``autocast_backward``."""
    params = list(model.parameters())
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(x).float().square().mean() * loss_scale
    return list(torch.autograd.grad(loss, params))


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    exact = exact.double()
    denominator = torch.linalg.vector_norm(exact)
    if denominator == 0:
        return float(torch.linalg.vector_norm(approx.double()))
    return float(torch.linalg.vector_norm(approx.double() - exact) / denominator)
