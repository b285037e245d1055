"""The least a 16-bit gradient store costs per parameter, next to torch.optim and mixedopt.

``python -m mixedopt.bench.small`` compares mixedopt with torch.optim on 64 x Linear(64, 64).
This asks what part of mixedopt's extra time any store of 16-bit gradients must pay with
torch's Python API, whatever it computes. Five variants of SGD with momentum take turns
iteration by iteration (``mixedopt.bench.small.time_in_turns``), on the same model and input:

* ``torch``: ``torch.optim.SGD(foreach=True)``, the reference.
* ``torch + hooks``: the same, with a pre-hook that does nothing on each parameter's
  ``AccumulateGrad`` node. Such a hook is the only place where a float32 gradient can be taken
  before autograd adds it to an earlier ``.grad`` (gradient accumulation).
* ``minimal store``: those hooks record the parameter; at the end of backward one
  ``_foreach_copy_`` gathers the gradients into a float32 buffer, one conversion rounds it to
  float16, and each ``p.grad`` is set to a view of it (made as mixedopt makes them,
  ``_rows.ViewRuns``). ``step()`` upcasts the buffer with one operation and calls torch's
  functional ``sgd(foreach=True)``. No scale, no inf/NaN check, no bookkeeping: float16 loses
  small gradients this way (a store needs a scale per tensor), so it is a floor, not an
  optimizer.
* ``minimal store + scales``: the same, with mixedopt's numerics and their operations: the
  power-of-two scale of each gradient from its largest magnitude, applied before the rounding
  and undone in ``step()``, which first checks the bounds for inf and NaN (and skips then).
  Still no bookkeeping: no accumulation, no check that a gradient is still the one stored.
* ``mixedopt``: ``mixedopt.SGD``.

It prints the median iteration, backward and step of each, in milliseconds and as a ratio to
torch's, and how far each variant's weights are from torch's at the end.

    python scripts/floor_small.py [--repeat 300] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.optim.sgd import sgd

import mixedopt
from mixedopt._rows import ROW, RowLayout, ViewRuns
from mixedopt._scales import any_non_finite, power_of_two_scale
from mixedopt._strides import contiguous_strides
from mixedopt.bench import small

LR, MOMENTUM = 1e-3, 0.9


class MinimalStore:
    """Float16 gradients with the least work per parameter: see the module's docstring."""

    def __init__(self, params: Any, scaled: bool = False) -> None:
        self.params = list(params)
        self.scaled = scaled
        self.momentum = {id(p): torch.zeros_like(p) for p in self.params}
        self.waiting: list[Tensor] = []
        self.order: list[Tensor] = []  # parameters in the order their gradients arrived
        self.nodes = []  # holding each AccumulateGrad node keeps its hook
        for param in self.params:
            param.grad_dtype = None  # accept a float16 .grad
            node = small.accumulate_grad_node(param)
            node.register_prehook(self._hook(param))
            self.nodes.append(node)

    def _hook(self, param: Tensor) -> Any:
        waiting = self.waiting

        def hook(grad_outputs: tuple[Tensor, ...]) -> None:
            if not waiting:
                torch.autograd.Variable._execution_engine.queue_callback(self._store)
            waiting.append(param)

        return hook

    @torch.no_grad()
    def _store(self) -> None:
        params, self.waiting[:] = list(self.waiting), []
        if len(params) != len(self.order) or any(map(operator.is_not, params, self.order)):
            self.order = params  # a new order: a new layout
            self.order_momentum = [self.momentum[id(p)] for p in params]
            device = params[0].device
            self.layout = RowLayout([p.numel() for p in params], device)
            self.runs = ViewRuns(
                [p.shape for p in params],
                [contiguous_strides(p.shape) for p in params],
                self.layout.offsets,
            )
            # zero where the rows pad
            self.staging = torch.zeros(self.layout.elements, device=device)
            self.staging_views = self.runs.views(self.staging)
        torch._foreach_copy_(self.staging_views, [p.grad for p in params])  # type: ignore[misc]
        rows = self.staging.view(self.layout.rows, ROW)
        if self.scaled:
            largest = torch.maximum(rows.amax(dim=1), -rows.amin(dim=1))
            self.bounds = self.layout.per_tensor_max(largest)
            self.scales = power_of_two_scale(self.bounds)
            rows.mul_(self.layout.per_row(self.scales))
        self.stored = rows.to(torch.float16)
        for param, grad in zip(params, self.runs.views(self.stored), strict=True):
            param.grad = grad

    @torch.no_grad()
    def step(self) -> None:
        """Upcast (and unscale) the stored buffer, then torch's functional SGD."""
        upcast = self.stored.float()
        if self.scaled:
            if any_non_finite(self.bounds).item():
                return
            upcast.div_(self.layout.per_row(self.scales))
        grads = self.runs.views(upcast)
        sgd(
            self.order,
            grads,
            self.order_momentum,  # type: ignore[arg-type]
            lr=LR,
            momentum=MOMENTUM,
            dampening=0.0,
            weight_decay=0.0,
            nesterov=False,
            maximize=False,
            foreach=True,
        )

    def zero_grad(self) -> None:
        """Set every ``p.grad`` to None, as torch.optim does."""
        for param in self.params:
            param.grad = None


def torch_sgd(params: Any) -> torch.optim.SGD:
    """The reference: torch.optim's SGD with momentum, foreach."""
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, foreach=True)


VARIANTS: dict[str, Callable[[Any], Any]] = {
    "torch": torch_sgd,
    "torch + hooks": small.with_empty_hooks(torch_sgd),
    "minimal store": MinimalStore,
    "minimal store + scales": lambda params: MinimalStore(params, scaled=True),
    "mixedopt": lambda params: mixedopt.SGD(params, lr=LR, momentum=MOMENTUM),
}


def main() -> None:
    """Print the times of each variant and how far its weights are from torch's."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeat", type=int, default=300, help="timed iterations (300)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    args = parser.parse_args()
    timed = small.time_in_turns(list(VARIANTS.values()), repeat=args.repeat, device=args.device)
    found = [(name, net, medians) for name, (net, medians) in zip(VARIANTS, timed, strict=True)]
    print(
        f"64 x Linear(64, 64) on {args.device}, batch 16, autocast(float16), SGD with momentum, "
        f"median of {args.repeat}, ms (ratio to torch):\n"
    )
    print("| variant | iteration | backward | step |\n|---|---:|---:|---:|")
    reference = found[0][2]
    for name, _, medians in found:
        cells = [
            f"{medians[key]:.2f} ({medians[key] / reference[key]:.2f}x)"
            for key in ("iteration", "backward", "step")
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")
    steps = args.repeat + 7  # small.time_in_turns's untimed iterations too
    print(f"\nLargest relative difference from torch's weights after {steps} steps:")
    torch_net = found[0][1]
    for name, net, _ in found[1:]:
        moved = max(
            ((a - b).abs().max() / a.abs().max()).item()
            for a, b in zip(torch_net.parameters(), net.parameters(), strict=True)
        )
        print(f"- {name}: {moved:.1e}")


if __name__ == "__main__":
    main()
