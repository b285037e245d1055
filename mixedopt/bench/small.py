"""The many-small-parameters regime: what a parameter costs in backward and in ``step()``.

On a GPU a model has hundreds of parameter tensors and every dispatched operation costs a launch
plus Python; a deep, narrow model on a CPU (``layers x Linear(width, width)``, batch 16) is the
cheap stand-in for that regime, where compute is small and per-operation costs decide.

Two measurements, side by side with torch.optim:

* ``count_ops``: the aten operations a piece of code dispatches, counted with a
  ``TorchDispatchMode``: deterministic, so the tests assert on them. ``op_counts`` counts one
  ``backward()`` and one ``step()`` of each pair below (the default paths; a compiled function
  refuses to run under such a mode, so the fused steps are timed only).
* ``iteration_times``: a training iteration (forward under ``autocast(float16)``, backward,
  ``step()``, ``zero_grad()``), its backward and its step timed separately, the two optimizers
  of a pair taking turns iteration by iteration (``in_turn``) so that the machine's drift reaches
  them alike. Ratios are mixedopt's time over torch.optim's: lower is faster.

``python -m mixedopt.bench`` prints both (``--no-small`` leaves them out);
``python -m mixedopt.bench.small [--repeat N] [--layers N] [--width N]`` prints them alone (a
width above 181 on a CPU makes each weight larger than a bucket takes: the regime of gradients
stored alone, just above that limit).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, TypedDict, TypeVar

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import mixedopt

from .setup import positive

T = TypeVar("T")

# name -> (torch.optim optimizer, mixedopt optimizer), each built from model.parameters().
PAIRS: dict[str, tuple[Callable[[Any], torch.optim.Optimizer], Callable[[Any], Any]]] = {
    "AdamW, default vs foreach": (
        lambda p: torch.optim.AdamW(p, foreach=True),
        lambda p: mixedopt.AdamW(p),
    ),
    "AdamW, fused vs fused": (
        lambda p: torch.optim.AdamW(p, fused=True),
        lambda p: mixedopt.AdamW(p, fused=True),
    ),
    "SGD momentum, default vs foreach": (
        lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9, foreach=True),
        lambda p: mixedopt.SGD(p, lr=1e-3, momentum=0.9),
    ),
    "RMSprop, default vs foreach": (
        lambda p: torch.optim.RMSprop(p, lr=1e-3, foreach=True),
        lambda p: mixedopt.RMSprop(p, lr=1e-3),
    ),
}


# One library's operation counts in ``report``: ``op_counts`` of the two model sizes, and the
# operations per parameter the larger one adds.
LibraryCounts = TypedDict(
    "LibraryCounts",
    {
        "16 params": dict[str, int],
        "128 params": dict[str, int],
        "per extra param": dict[str, float],
    },
)


class _Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.count += 1
        return func(*args, **(kwargs or {}))


def in_turn(items: Sequence[T], round_index: int) -> list[T]:
    """``items`` rotated by ``round_index``: each round of timed runs starts with the next one.

    Which variant runs right after which moves its time by several percent on a shared CPU
    (measured: up to 0.3 ms of a 10 ms backward); rotating the order spreads that over all.
    """
    shift = round_index % len(items) if items else 0
    return [*items[shift:], *items[:shift]]


def count_ops(fn: Callable[[], Any]) -> int:
    """The aten operations ``fn()`` dispatches (views included)."""
    with _Counter() as counter:
        fn()
    return counter.count


def model(layers: int, width: int, seed: int = 0, device: str = "cpu") -> nn.Module:
    """``layers x Linear(width, width)``: ``2 x layers`` parameters, the same for a seed."""
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).to(device)


def accumulate_grad_node(param: torch.Tensor) -> Any:
    """The ``AccumulateGrad`` node of a leaf ``param`` (keep it: it holds the hooks put on it)."""
    view = param.view_as(param)
    assert view.grad_fn is not None, "a parameter that requires grad"
    return view.grad_fn.next_functions[0][0]


def with_empty_hooks(make: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``make``, plus a pre-hook that does nothing on each parameter's ``AccumulateGrad`` node.

    Such a hook is the only place where a float32 gradient can be taken before autograd adds
    it to an earlier ``.grad``: what it costs, any store of 16-bit gradients pays first. The
    optimizer made keeps the nodes (``nodes``), and so their hooks.
    """

    def made(params: Any) -> Any:
        params = list(params)
        opt = make(params)
        opt.nodes = []
        for param in params:
            node = accumulate_grad_node(param)
            node.register_prehook(lambda grad_outputs: None)
            opt.nodes.append(node)
        return opt

    return made


def _loss(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.autocast(x.device.type, dtype=torch.float16):
        return net(x).float().square().mean()


def op_counts(
    make: Callable[[Any], Any], layers: int, width: int = 32, batch: int = 16
) -> dict[str, int]:
    """Operations of one ``backward()`` and one ``step()``, after two warm-up iterations."""
    net = model(layers, width)
    opt = make(net.parameters())
    x = torch.randn(batch, width)
    for _ in range(2):
        _loss(net, x).backward()
        opt.step()
        opt.zero_grad()
    loss = _loss(net, x)
    return {"backward": count_ops(loss.backward), "step": count_ops(opt.step)}


def per_parameter(
    counts_small: dict[str, int], counts_large: dict[str, int], extra: int
) -> dict[str, float]:
    """Operations per parameter added between two model sizes (``extra`` more parameters)."""
    return {key: (counts_large[key] - counts_small[key]) / extra for key in counts_small}


def time_in_turns(
    makers: Sequence[Callable[[Any], Any]],
    layers: int = 64,
    width: int = 64,
    batch: int = 16,
    repeat: int = 50,
    warmup: int = 5,
    device: str = "cpu",
) -> list[tuple[nn.Module, dict[str, float]]]:
    """Each maker's optimizer on its own ``model`` (the same for all), the iterations in turns.

    For each maker, its model after the iterations and the median milliseconds of an
    iteration, its backward and its step.
    """
    x = torch.randn(batch, width, device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    runs = []
    for make in makers:
        net = model(layers, width, device=device)
        opt = make(net.parameters())
        times: dict[str, list[float]] = {"iteration": [], "backward": [], "step": []}

        def iteration(net: nn.Module = net, opt: Any = opt, times: Any = times) -> None:
            sync()
            start = time.perf_counter()
            loss = _loss(net, x)
            sync()
            before_backward = time.perf_counter()
            loss.backward()
            sync()
            before_step = time.perf_counter()
            opt.step()
            sync()
            after_step = time.perf_counter()
            opt.zero_grad()
            sync()
            end = time.perf_counter()
            times["iteration"].append(end - start)
            times["backward"].append(before_step - before_backward)
            times["step"].append(after_step - before_step)

        for _ in range(warmup + 2):  # a fused step that compiles does so in the first two
            iteration()
        for values in times.values():
            values.clear()
        runs.append((net, iteration, times))
    for round_index in range(repeat):
        for _, iteration, _ in in_turn(runs, round_index):
            iteration()
    return [
        (net, {key: 1e3 * statistics.median(values) for key, values in times.items()})
        for net, _, times in runs
    ]


def iteration_times(
    pair: str,
    layers: int = 64,
    width: int = 64,
    batch: int = 16,
    repeat: int = 50,
    warmup: int = 5,
    device: str = "cpu",
) -> dict[str, dict[str, float]]:
    """Median milliseconds of an iteration, its backward and its step, for both of ``pair``."""
    (_, torch_times), (_, mixed_times) = time_in_turns(
        PAIRS[pair], layers, width, batch, repeat, warmup, device
    )
    return {"torch": torch_times, "mixedopt": mixed_times}


def report(
    repeat: int = 50, device: str = "cpu", layers: int = 64, width: int = 64
) -> tuple[str, dict[str, Any]]:
    """The regime's tables as text, and their figures.

    The iterations time ``layers x Linear(width, width)``; the operation counts are always of
    8 and 64 x ``Linear(32, 32)``.
    """
    counts: dict[str, dict[str, LibraryCounts]] = {}
    for pair, makers in PAIRS.items():
        if "fused" in pair:
            continue
        counts[pair] = {}
        for library, make in zip(("torch", "mixedopt"), makers, strict=True):
            small, large = op_counts(make, 8), op_counts(make, 64)
            counts[pair][library] = {
                "16 params": small,
                "128 params": large,
                "per extra param": per_parameter(small, large, 112),
            }
    times = {
        pair: iteration_times(pair, layers=layers, width=width, repeat=repeat, device=device)
        for pair in PAIRS
    }
    lines = [
        "Aten operations dispatched, 8 and 64 x Linear(32, 32) (16 and 128 parameters):",
        "",
        "| optimizers | | backward, 16 | backward, 128 | step, 16 | step, 128 | "
        "per extra parameter: backward | step |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for pair, by_library in counts.items():
        for library, found in by_library.items():
            small, large, each = found["16 params"], found["128 params"], found["per extra param"]
            lines.append(
                f"| {pair} | {library} | {small['backward']} | {large['backward']} | "
                f"{small['step']} | {large['step']} | {each['backward']:.2f} | {each['step']:.2f} |"
            )
    lines += [
        "",
        f"Training iteration of {layers} x Linear({width}, {width}), batch 16, autocast(float16), "
        f"median of {repeat}, ms (mixedopt / torch.optim):",
        "",
        "| optimizers | iteration | backward | step |",
        "|---|---:|---:|---:|",
    ]
    for pair, medians in times.items():
        cells = []
        for key in ("iteration", "backward", "step"):
            ours, theirs = medians["mixedopt"][key], medians["torch"][key]
            cells.append(f"{ours:.2f} / {theirs:.2f} = {ours / theirs:.2f}x")
        lines.append(f"| {pair} | " + " | ".join(cells) + " |")
    return "\n".join(lines), {"op_counts": counts, "iteration_ms": times}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        prog="python -m mixedopt.bench.small",
        description="The many-small-parameters regime alone: operations dispatched per backward "
        "and per step, and iteration times of --layers x Linear(--width, --width) (64 x "
        "Linear(64, 64) by default), mixedopt next to torch.optim.",
    )
    parser.add_argument("--repeat", type=positive, default=100, help="timed iterations (100)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument(
        "--layers", type=positive, default=64, help="Linear layers of the timed model (64)"
    )
    parser.add_argument(
        "--width",
        type=positive,
        default=64,
        help="their width (64); above 181 on a CPU each weight is larger than a bucket takes "
        "(32Ki elements), and its gradient is stored alone",
    )
    args = parser.parse_args()
    print(report(repeat=args.repeat, device=args.device, layers=args.layers, width=args.width)[0])
