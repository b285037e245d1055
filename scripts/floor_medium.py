"""The least a 16-bit gradient store costs on medium tensors, next to torch.optim and mixedopt.

``python -m mixedopt.bench`` compares mixedopt with torch.optim on the medium-tensors MLP
(``mixedopt.bench.medium``: 256-512-512-512-10, batch 128, autocast(float16), AdamW). This asks
what part of mixedopt's extra time any optimizer that stores float16 gradients in backward, as
mixedopt does, must pay with torch's eager operations, whatever its bookkeeping. Four variants
take turns iteration by iteration (``mixedopt.bench.medium.time_in_turns``), on the same model
and input:

* ``torch``: ``torch.optim.AdamW(foreach=True)``, the reference.
* ``torch + hooks``: the same, with a pre-hook that does nothing on each parameter's
  ``AccumulateGrad`` node, the only place where a float32 gradient can be taken before
  autograd adds it to an earlier ``.grad``.
* ``minimal store``: those hooks store each gradient with mixedopt's numerics in the fewest
  operations it has: the largest magnitude read on the host, the power-of-two scale found
  there, the gradient scaled where it is and rounded into a new float16 ``.grad``. ``step()``
  skips when a largest magnitude is inf or NaN, else upcasts the gradients into new float32
  memory, let go after the update (as torch.optim's temporaries are: float32 copies kept
  between steps would hold what float16 saves), unscales them with one operation and calls
  torch's functional ``adamw(foreach=True)`` once. No bookkeeping: no accumulation, no
  buckets, no check that a gradient is still the one stored, safe on one thread only.
* ``mixedopt``: ``mixedopt.AdamW``.

It prints the median iteration, forward and backward, and step of each, in milliseconds and as
a ratio to torch's, and whether the minimal store's weights at the end are mixedopt's, bit for
bit (the same float16 gradients and the same update: its times are those of mixedopt's work).

    python scripts/floor_medium.py [--repeat 300] [--threads 1]
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.optim.adamw import adamw

import mixedopt
from mixedopt._scales import abs_max_on_host, power_of_two_scale_on_host
from mixedopt.bench import medium, small

# torch.optim.AdamW's defaults, which the benchmark's optimizers take.
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 1e-2


class MinimalStore:
    """Float16 gradients with mixedopt's numerics and the least work: see the module."""

    def __init__(self, params: Any) -> None:
        self.params = list(params)
        self.state = {
            p: (torch.zeros_like(p), torch.zeros_like(p), torch.tensor(0.0)) for p in self.params
        }
        self.scales: dict[Tensor, float] = {}
        self.bounds: dict[Tensor, float] = {}
        self.nodes = []  # holding each AccumulateGrad node keeps its hook
        for param in self.params:
            param.grad_dtype = None  # accept a float16 .grad
            node = small.accumulate_grad_node(param)
            node.register_prehook(self._hook(param))
            self.nodes.append(node)

    def _hook(self, param: Tensor) -> Callable[[tuple[Tensor, ...]], tuple[None]]:
        def hook(grad_outputs: tuple[Tensor, ...]) -> tuple[None]:
            grad = grad_outputs[0]  # float32, held by nothing else: scaled where it is
            bound = abs_max_on_host(grad)
            scale = power_of_two_scale_on_host(bound)
            stored = torch.empty_like(param, dtype=torch.float16)
            with torch.no_grad():
                stored.copy_(grad.mul_(scale))
            param.grad = stored
            self.scales[param], self.bounds[param] = scale, bound
            return (None,)  # taken: autograd stores nothing

        return hook

    @torch.no_grad()
    def step(self) -> None:
        """Skip on inf or NaN, else upcast and unscale, then torch's functional AdamW."""
        if not all(map(math.isfinite, self.bounds.values())):
            return
        # Fresh float32 memory, let go after the update, as torch.optim's temporaries are (a
        # float32 copy of every gradient kept between steps would hold what float16 saves).
        grads = [p.grad.float() for p in self.params]  # type: ignore[union-attr]
        torch._foreach_mul_(grads, [1.0 / self.scales[p] for p in self.params])
        exp_avgs, exp_avg_sqs, steps = zip(*(self.state[p] for p in self.params), strict=True)
        adamw(
            self.params,
            grads,
            list(exp_avgs),
            list(exp_avg_sqs),
            [],
            list(steps),
            foreach=True,
            amsgrad=False,
            beta1=BETAS[0],
            beta2=BETAS[1],
            lr=LR,
            weight_decay=WEIGHT_DECAY,
            eps=EPS,
            maximize=False,
        )

    def zero_grad(self) -> None:
        """Set every ``p.grad`` to None, as torch.optim does."""
        for param in self.params:
            param.grad = None


def torch_adamw(params: Any) -> torch.optim.AdamW:
    """The reference: torch.optim's AdamW, foreach."""
    return torch.optim.AdamW(params, foreach=True)


VARIANTS: dict[str, Callable[[Any], Any]] = {
    "torch": torch_adamw,
    "torch + hooks": small.with_empty_hooks(torch_adamw),
    "minimal store": MinimalStore,
    "mixedopt": mixedopt.AdamW,
}


def main() -> None:
    """Print the times of each variant and whether the minimal store's weights are mixedopt's."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeat", type=int, default=300, help="timed iterations (300)")
    parser.add_argument("--threads", type=int, default=1, help="torch's CPU threads (1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    makers = [(make, torch.autocast) for make in VARIANTS.values()]
    timed = dict(zip(VARIANTS, medium.time_in_turns(makers, repeat=args.repeat), strict=True))
    print(
        f"MLP {'-'.join(map(str, medium.WIDTHS))} on the CPU ({args.threads} thread(s)), batch "
        f"{medium.BATCH}, autocast(float16), AdamW, median of {args.repeat}, ms (ratio to "
        "torch):\n"
    )
    print("| variant | iteration | fwd+bwd | step |\n|---|---:|---:|---:|")
    reference = timed["torch"][1]
    for name, (_, medians) in timed.items():
        cells = [
            f"{medians[part]:.2f} ({medians[part] / reference[part]:.2f}x)"
            for part in ("iteration", "fwd+bwd", "step")
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")
    minimal, mixed = timed["minimal store"][0], timed["mixedopt"][0]
    same = all(
        torch.equal(a, b) for a, b in zip(minimal.parameters(), mixed.parameters(), strict=True)
    )
    print(f"\nThe minimal store's weights are mixedopt's, bit for bit: {'yes' if same else 'no'}")


if __name__ == "__main__":
    main()
