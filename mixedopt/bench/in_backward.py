"""``python -m mixedopt.bench.in_backward``: what ``step_in_backward()`` saves, and what it costs.

Memory
    Bytes per parameter at the peak of a training iteration of ``--layers x Linear(--width,
    --width)`` (by default 64 x 1024 x 1024: 67M parameters) with Adam, batch 1 so that the
    activations are negligible, for four ways of stepping: torch.optim.Adam with
    ``foreach=False`` and ``foreach=True``, mixedopt.Adam with ``backward(); step()``, and
    mixedopt.Adam with ``step_in_backward()``. The figure is everything the model, its optimizer
    and the iteration hold at the peak: (peak - memory before the model was built) / parameters,
    so weights (4 B) and Adam's state (8 B) are in it. "Before" is after one iteration of a tiny
    model of the same kind, so that what torch sets up once whatever the model (threads, the
    autograd engine, its allocator's arenas) is not counted per parameter. The weights are
    scaled so that the values keep their size through the layers.

    Three times: with a float32 forward; with the forward under ``torch.autocast(float16)``,
    which keeps a float16 copy of every weight for backward until backward has used it (2 B per
    parameter at the start of backward, whatever the optimizer); and under
    ``mixedopt.autocast(float16)``, which saves none and casts the weights again in backward.

    On a CPU each figure comes from a fresh interpreter (``memory.run_memory_child``): two
    iterations (the state exists), a reset of the resident-set high-water mark, one iteration,
    then VmHWM; on CUDA from the allocator's peak.

Speed
    A training iteration (forward under ``autocast(float16)``, or ``--autocast-dtype
    bfloat16``, backward, step, zero_grad) with
    ``backward(); step()``, with ``step_in_backward()``, and with ``step_in_backward()`` and the
    forward under ``mixedopt.autocast`` (mixedopt.AdamW), taking turns, on
    the 4-layer 1024-wide MLP (batch 64) and on 64 x Linear(64, 64) (batch 16): median times and
    their ratio (lower is faster).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

import mixedopt

from . import small
from .memory import malloc_trim, proc_status, reset_hwm, run_memory_child
from .setup import positive
from .timing import timed

STEPPED = "backward(); step()"
IN_BACKWARD = "step_in_backward()"

# How each way of stepping makes its optimizer (from the parameters).
MEMORY_MODES: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "torch.optim.Adam, foreach=False": lambda p: torch.optim.Adam(p, foreach=False),
    "torch.optim.Adam, foreach=True": lambda p: torch.optim.Adam(p, foreach=True),
    f"mixedopt.Adam, {STEPPED}": lambda p: mixedopt.Adam(p),
    f"mixedopt.Adam, {IN_BACKWARD}": lambda p: mixedopt.Adam(p),
}


def speed_models(mlp_layers: int = 4) -> dict[str, tuple[int, int, int]]:
    """The models the speed is measured on: name -> (layers, width, batch).

    More MLP layers than 4 (4M parameters) make the updating backward update some of them
    before backward ends (``_in_backward.UPDATE_BATCH``).
    """
    return {
        f"{mlp_layers}-layer 1024-wide MLP, batch 64": (mlp_layers, 1024, 64),
        "64 x Linear(64, 64), batch 16": (64, 64, 16),
    }


SPEED_MODELS = speed_models()


def scaled_model(layers: int, width: int, device: str = "cpu") -> nn.Module:
    """``layers x Linear(width, width)`` whose activations keep their size through the layers."""
    model = small.model(layers, width, device=device)
    with torch.no_grad():
        for layer in model.children():
            assert isinstance(layer, nn.Linear)
            layer.weight.mul_(3**0.5)  # uniform(-1/sqrt(n), 1/sqrt(n)) has variance 1/(3n)
    return model


# name -> the context a forward runs in, on a device type, computing in a 16-bit dtype.
FORWARDS: dict[str, Callable[[str, torch.dtype], contextlib.AbstractContextManager[Any]]] = {
    "float32": lambda device_type, dtype: contextlib.nullcontext(),
    "torch.autocast": lambda device_type, dtype: torch.autocast(device_type, dtype=dtype),
    "mixedopt.autocast": lambda device_type, dtype: mixedopt.autocast(device_type, dtype=dtype),
}


def iteration(
    model: nn.Module,
    opt: Any,
    x: torch.Tensor,
    in_backward: bool,
    forward: str = "torch.autocast",
    dtype: torch.dtype = torch.float16,
) -> None:
    """One training iteration, its forward in ``FORWARDS[forward]``, stepping after or in it."""
    with FORWARDS[forward](x.device.type, dtype):
        loss = model(x).float().square().mean()
    if in_backward:
        with opt.step_in_backward():
            loss.backward()
        return
    loss.backward()
    opt.step()
    opt.zero_grad()


def _allocated(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return proc_status()["VmRSS"]


def peak_bytes_per_parameter(spec: dict[str, Any]) -> dict[str, Any]:
    """In this process: the peak of one iteration of ``spec``, per parameter (module doc)."""
    device = torch.device(spec["device"])
    make = MEMORY_MODES[spec["mode"]]
    in_backward = spec["mode"].endswith(IN_BACKWARD)

    def run(layers: int, width: int, iterations: int) -> tuple[nn.Module, Any]:
        model = scaled_model(layers, width, device=spec["device"])
        opt = make(model.parameters())
        x = torch.randn(1, width, device=device)
        for _ in range(iterations):
            iteration(model, opt, x, in_backward, spec["forward"])
        return model, opt

    tiny, tiny_opt = run(2, 8, 2)  # what torch sets up once
    if hasattr(tiny_opt, "remove_grad_storage"):
        tiny_opt.remove_grad_storage()
    del tiny, tiny_opt
    gc.collect()
    malloc_trim()
    before = _allocated(device)
    model, opt = run(spec["layers"], spec["width"], 2)  # the state exists
    x = torch.randn(1, spec["width"], device=device)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        malloc_trim()
        reset_hwm()
    iteration(model, opt, x, in_backward, spec["forward"])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
    else:
        peak = proc_status()["VmHWM"]
    params = sum(p.numel() for p in model.parameters())
    if hasattr(opt, "remove_grad_storage"):
        opt.remove_grad_storage()
    return {"bytes_per_param": (peak - before) / params, "params": params}


def memory_table(
    layers: int = 64,
    width: int = 1024,
    device: str = "cpu",
    modes: Sequence[str] = tuple(MEMORY_MODES),
    forwards: Sequence[str] = tuple(FORWARDS),
) -> dict[str, dict[str, Any]]:
    """``{mode: {forward: figure}}``, each figure a ``peak_bytes_per_parameter`` result.

    On a CPU each figure is measured in a fresh interpreter.
    """
    found: dict[str, dict[str, Any]] = {}
    for mode in modes:
        found[mode] = {}
        for forward in forwards:
            spec = {
                "mode": mode,
                "layers": layers,
                "width": width,
                "device": device,
                "forward": forward,
            }
            if torch.device(device).type == "cpu":
                result = run_memory_child(
                    "mixedopt.bench.in_backward", ["--child", json.dumps(spec)]
                )
            else:
                result = peak_bytes_per_parameter(spec)
            found[mode][forward] = result
    return found


# name -> (steps in backward, the forward's context in FORWARDS), the ways the speed is timed.
SPEED_WAYS = {
    STEPPED: (False, "torch.autocast"),
    IN_BACKWARD: (True, "torch.autocast"),
    f"{IN_BACKWARD}, mixedopt.autocast": (True, "mixedopt.autocast"),
}


def iteration_times(
    layers: int,
    width: int,
    batch: int,
    repeat: int = 50,
    warmup: int = 5,
    device: str = "cpu",
    dtype: torch.dtype = torch.float16,
) -> dict[str, float]:
    """Median milliseconds of an iteration in each of ``SPEED_WAYS``, taking turns.

    The forward computes in ``dtype`` (autocast's); the gradients are float16 either way.
    """
    x = torch.randn(batch, width, device=device)
    runs: dict[str, tuple[Callable[[], None], Any, list[float]]] = {}
    for name, (in_backward, forward) in SPEED_WAYS.items():
        model = small.model(layers, width, device=device)
        opt = mixedopt.AdamW(model.parameters())

        def run(
            model: nn.Module = model,
            opt: Any = opt,
            in_backward: bool = in_backward,
            forward: str = forward,
        ) -> None:
            iteration(model, opt, x, in_backward, forward, dtype)

        for _ in range(warmup):
            run()
        runs[name] = (run, opt, [])
    for round_index in range(repeat):
        for iterate, _, times in small.in_turn(list(runs.values()), round_index):
            times.append(1e3 * timed(iterate, x.device))
    for _, opt, _ in runs.values():
        opt.remove_grad_storage()
    return {name: statistics.median(times) for name, (_, _, times) in runs.items()}


def report(
    layers: int = 64,
    width: int = 1024,
    repeat: int = 50,
    device: str = "cpu",
    memory: bool = True,
    dtype: torch.dtype = torch.float16,
    models: dict[str, tuple[int, int, int]] | None = None,
) -> tuple[str, dict[str, Any]]:
    """Both tables as text, and their figures.

    The speed table's forward computes in ``dtype``, on ``models`` (by default ``SPEED_MODELS``).
    """
    lines = []
    figures: dict[str, Any] = {}
    if memory:
        table = memory_table(layers, width, device)
        figures["memory"] = table
        params = next(iter(table.values()))["float32"].get("params", 0)
        lines += [
            f"Peak of a training iteration, bytes per parameter (weights 4 + Adam state 8 + the "
            f"rest), {layers} x Linear({width}, {width}) = {params:,} parameters, batch 1, "
            "by the forward's context:",
            "",
            "| stepping | " + " | ".join(FORWARDS) + " |",
            "|---|" + "---:|" * len(FORWARDS),
        ]
        for mode, found in table.items():
            cells = [
                f"{r['bytes_per_param']:.2f}" if "bytes_per_param" in r else r.get("error", "?")
                for r in found.values()
            ]
            lines.append(f"| {mode} | " + " | ".join(cells) + " |")
        lines.append("")
    figures["iteration_ms"] = {}
    ways = list(SPEED_WAYS)
    lines += [
        f"Training iteration, mixedopt.AdamW, autocast({str(dtype).removeprefix('torch.')}), "
        f"median of {repeat}, ms "
        f"(ratios to {STEPPED}):",
        "",
        "| model | " + " | ".join(ways) + " |",
        "|---|" + "---:|" * len(ways),
    ]
    for name, (model_layers, model_width, batch) in (models or SPEED_MODELS).items():
        times = iteration_times(
            model_layers, model_width, batch, repeat, device=device, dtype=dtype
        )
        figures["iteration_ms"][name] = times
        base = times[STEPPED]
        cells = [f"{times[STEPPED]:.2f}"]
        cells += [f"{times[way]:.2f} = {times[way] / base:.2f}x" for way in ways[1:]]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines), figures


def main(argv: Sequence[str] | None = None) -> int:
    """Print both tables (``--no-memory``: the speed table only); return the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m mixedopt.bench.in_backward",
        description="Memory and speed of step_in_backward() next to backward(); step().",
    )
    parser.add_argument("--layers", type=positive, default=64, help="memory model (64)")
    parser.add_argument("--width", type=positive, default=1024, help="its width (1024)")
    parser.add_argument("--repeat", type=positive, default=50, help="timed iterations")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--no-memory", dest="memory", action="store_false", help="speed only")
    parser.add_argument(
        "--autocast-dtype",
        choices=["float16", "bfloat16"],
        default="float16",
        help="the dtype the timed forwards compute in (float16); bfloat16 shows the optimizer's "
        "share on a CPU whose float16 matrix products are slow",
    )
    parser.add_argument(
        "--mlp-layers",
        type=positive,
        help="layers of the timed 1024-wide MLP (4); more than 4 update some in backward",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the figures")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(peak_bytes_per_parameter(json.loads(args.child))))
        return 0
    dtype = getattr(torch, args.autocast_dtype)
    models = None if args.mlp_layers is None else speed_models(args.mlp_layers)
    text, figures = report(
        args.layers, args.width, args.repeat, args.device, args.memory, dtype, models
    )
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
