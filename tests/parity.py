"""Parity with torch.optim, judged against autograd's own float32 gradients.

A ``Trio`` trains the same parameters three ways, on the same losses:

- ``mixed``: under the mixedopt optimizer, its gradients stored in 16 bits by its hooks;
- ``rounded``: under torch.optim, fed autograd's float32 gradients of a twin backward, rounded
  as docs/grad.md says the storage rounds them (``stored_as_documented``, ``accumulated``);
- ``exact``: under torch.optim, fed autograd's float32 gradients as they are (torch's own
  accumulation in ``.grad``).

``mixed`` must equal ``rounded`` to float32 noise (``assert_matches_rounded``) and ``exact``
within what the documented rounding allows (``assert_within_rounding_of_exact``). Nothing here
reads mixedopt's own decoding of its gradients (``true_grad``): a gradient stored at a wrong
scale, a step that unscales wrongly, a micro-batch lost, all show as a difference.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from helpers import (
    ACCELERATOR_BUDGETS,
    EPS32,
    EVERY_OPTIMIZER,
    MATRICES,
    NOISE_ULPS,
    NON_EMPTY,
    OPTIMIZERS,
    SHAPES,
    TORCH_FUSED_ONLY,
    assert_close_to_float32_noise,
    hyperparameters,
    packing,
)
from hypothesis import strategies as st
from torch import Tensor, nn

import mixedopt

# The largest error of the documented rounding of one gradient, relative to the largest magnitude
# of its tensor. float16: the storage scale puts that magnitude in [2**7, 2**8), where half a
# float16 ulp is 2**-4, so an element is off by at most 2**-4 / 2**7 of it (elements below, and
# float16's subnormal ones, by less). bfloat16: 8 significant bits, each element off by at most
# 2**-8 of itself.
UNIT = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def stored_as_documented(grad: Tensor, grad_dtype: torch.dtype = torch.float16) -> Tensor:
    """The float32 value the storage keeps of ``grad``, following docs/grad.md only.

    float16: times ``2**k``, the power of two that puts the largest magnitude in [128, 256)
    (``k`` within [-126, 126]; the largest for a zero gradient), rounded to float16 and divided
    back. bfloat16: rounded to bfloat16.
    """
    if grad_dtype == torch.bfloat16:
        return grad.bfloat16().float()
    amax = grad.abs().max().item() if grad.numel() else 0.0
    if not math.isfinite(amax):
        return grad.half().float()  # non-finite stays non-finite: the step is skipped
    exponent = math.frexp(amax)[1] if amax > 0 else -1000  # amax = m * 2**e, m in [0.5, 1)
    k = min(max(8 - exponent, -126), 126)
    return (grad * 2.0**k).half().float() / 2.0**k


def assert_within_documented_rounding(
    found: Tensor, exact: Tensor, grad_dtype: torch.dtype = torch.float16
) -> None:
    """``found`` differs from ``exact`` by at most one documented rounding (``UNIT`` of the
    largest magnitude of ``exact``) in every element, and is that rounding, to float32 noise."""
    if exact.numel():
        error = (found - exact).abs().max().item()
        assert error <= UNIT[grad_dtype] * exact.abs().max().item()
    assert_close_to_float32_noise(found, stored_as_documented(exact, grad_dtype))


def accumulated(grads: Sequence[Tensor], grad_dtype: torch.dtype = torch.float16) -> Tensor:
    """What the storage keeps of micro-batch gradients added in ``.grad`` (docs/grad.md):
    each new one added in float32 to the value stored so far, and the sum stored again."""
    total = stored_as_documented(grads[0], grad_dtype)
    for grad in grads[1:]:
        total = stored_as_documented(total + grad, grad_dtype)
    return total


def round_gradients_as_stored(params, grad_dtype: torch.dtype = torch.float16) -> None:
    """Replace each float32 ``.grad`` of ``params`` by its documented rounding: a twin's
    gradients as torch.optim should see them to step as mixedopt does."""
    for q in params:
        if q.grad is not None:
            q.grad = stored_as_documented(q.grad, grad_dtype)


def gradient_tensors(shapes, magnitudes, spread, generator) -> list[Tensor]:
    """One float32 gradient per shape: normal values times ``10**magnitude``, each element
    also times ``10**-(spread * U)``, ``U`` uniform in [0, 1): spread over ``spread`` decades."""
    grads = []
    for shape, magnitude in zip(shapes, magnitudes, strict=True):
        g = torch.randn(shape, generator=generator) * 10.0**magnitude
        if spread:
            g = g * 10.0 ** (-spread * torch.rand(shape, generator=generator))
        grads.append(g)
    return grads


def loss_with_gradients(grads: Sequence[Tensor]) -> Callable[[list[nn.Parameter]], Tensor]:
    """A micro-batch whose loss has exactly ``grads`` as its gradients."""
    return lambda params: sum((p * g).sum() for p, g in zip(params, grads, strict=True))


@dataclass
class Side:
    """One of a trio's three trainings: parameters, optimizer, GradScaler."""

    params: list[nn.Parameter]
    opt: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    skipped: int = 0
    norms: list[Tensor] = field(default_factory=list)  # clip_grad_norm_'s, one per step


class Trio:
    """The same parameters under a mixedopt optimizer and, as references, under its torch.optim
    parent fed autograd's gradients rounded as documented (``rounded``) and as they are
    (``exact``). See the module's docstring.

    ``path``: "default", "fused" (``fused=True``) or "step_in_backward" (the last micro-batch
    of an iteration runs under ``optimizer.step_in_backward()``). ``loss_scale``: a GradScaler
    of that initial scale on each side. ``max_grad_norm``: mixedopt's clipping, against
    ``clip_grad_norm_`` of the references' gradients.
    """

    def __init__(
        self,
        name: str,
        kwargs: dict[str, Any],
        initial: Sequence[Tensor],
        *,
        path: str = "default",
        grad_dtype: torch.dtype = torch.float16,
        max_grad_norm: float | None = None,
        loss_scale: float | None = None,
    ) -> None:
        mixed_cls = getattr(mixedopt, name)
        torch_cls = getattr(torch.optim, name)
        self.path, self.grad_dtype, self.max_grad_norm = path, grad_dtype, max_grad_norm
        self.kwargs = kwargs
        extra = {"fused": True} if path == "fused" else {}

        def side(cls, **more):
            params = [nn.Parameter(t.clone()) for t in initial]
            scaler = None
            if loss_scale is not None:
                scaler = torch.amp.GradScaler("cpu", init_scale=loss_scale, growth_interval=2)
            return Side(params, cls(params, **kwargs, **more), scaler)

        self.mixed = side(mixed_cls, grad_dtype=grad_dtype, max_grad_norm=max_grad_norm, **extra)
        self.rounded = side(torch_cls)
        self.exact = side(torch_cls)
        self.sides = (self.mixed, self.rounded, self.exact)
        self.gradient_bound = [0.0] * len(initial)  # this iteration's, per tensor
        self.gradient_largest = [0.0] * len(initial)
        self.weight_error = [0.0] * len(initial)  # mixed vs exact, before this iteration
        self.weight_largest = [0.0] * len(initial)  # exact's, before this iteration
        self.skipped_now = False  # whether this iteration's step was skipped
        self.clipping_noise = 0.0  # relative difference of the clipping coefficients, summed
        self.cancellation = 1.0  # see ``_record_cancellation``
        self.iterations = 0
        # Per parameter: the bound of each quantity on how far mixed is from exact.
        self.bounds: list[dict[str, float | None]] = [{"weight": 0.0} for _ in initial]
        self.held: dict[int, float] = {}  # id of a reference tensor -> its largest |value|

    # ------------------------------------------------------------------ one iteration

    def iteration(self, micro_batches: Sequence[Callable[[list[nn.Parameter]], Tensor]]) -> None:
        """Backward over each micro-batch's loss (a function of a side's parameters), then the
        step on all three sides, then ``zero_grad()``."""
        self.iterations += 1
        mixed, exact = self.mixed, self.exact.params
        self.weight_error = [
            _max_difference(p, q) for p, q in zip(mixed.params, exact, strict=True)
        ]
        self.weight_largest = [_largest(q) for q in exact]
        for i, loss_of in enumerate(micro_batches):
            loss = loss_of(mixed.params)
            if mixed.scaler is not None:
                loss = mixed.scaler.scale(loss)
            last = i == len(micro_batches) - 1
            updating = self.path == "step_in_backward" and last
            with mixed.opt.step_in_backward() if updating else contextlib.nullcontext():
                loss.backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a skipped step's warning
            if self.path != "step_in_backward":
                if mixed.scaler is not None:
                    mixed.scaler.step(mixed.opt)
                    mixed.scaler.update()
                else:
                    mixed.opt.step()
            mixed.opt.zero_grad()
        self._reference_iteration(micro_batches)

    def _reference_iteration(self, micro_batches) -> None:
        exact, rounded = self.exact, self.rounded
        per_param: list[list[Tensor]] = [[] for _ in exact.params]
        for loss_of in micro_batches:
            loss, twin = loss_of(exact.params), loss_of(rounded.params)
            if exact.scaler is not None:
                loss, twin = exact.scaler.scale(loss), rounded.scaler.scale(twin)
            loss.backward()  # torch's own float32 accumulation in .grad
            found = torch.autograd.grad(twin, rounded.params, allow_unused=True)
            for grads, g in zip(per_param, found, strict=True):
                if g is not None:  # a parameter the loss does not use gets no gradient
                    grads.append(g)
        for q, grads in zip(rounded.params, per_param, strict=True):
            q.grad = accumulated(grads, self.grad_dtype) if grads else None
        self._record_gradient_bounds(per_param)
        skipped = exact.skipped
        for side in (rounded, exact):
            self._reference_step(side)
        self.skipped_now = exact.skipped > skipped
        if not self.skipped_now and self.max_grad_norm is not None:
            # Both sides clip by the norm of the same values, summed in other orders: each
            # gradient is off by the coefficients' relative difference, and stays in the state.
            mine, theirs = self._clip_coefficients(rounded)
            self.clipping_noise += abs(mine - theirs) / theirs
        if not self.skipped_now:
            self._carry_bounds()

    def _record_gradient_bounds(self, per_param: list[list[Tensor]]) -> None:
        """How far each ``rounded`` gradient may be from ``exact``'s, in true (unscaled) values:
        a rounding of each partial sum, ``UNIT`` of its largest magnitude; and the largest
        magnitude of ``exact``'s."""
        scale = self.exact.scaler.get_scale() if self.exact.scaler is not None else 1.0
        for i, (grads, q) in enumerate(zip(per_param, self.exact.params, strict=True)):
            bound, total = 0.0, torch.zeros_like(q)
            for g in grads:
                total = total + g
                bound += UNIT[self.grad_dtype] * _largest(total) / scale
            self.gradient_bound[i] = bound
            self.gradient_largest[i] = _largest(total) / scale

    def _reference_step(self, side: Side) -> None:
        """torch.optim's step as its documentation has users write it; a step with an inf or
        NaN gradient is skipped, weights and state untouched, as mixedopt documents."""
        finite = all(q.grad.isfinite().all() for q in side.params if q.grad is not None)
        if side.scaler is not None:
            side.scaler.unscale_(side.opt)
        if self.max_grad_norm is not None:
            side.norms.append(torch.nn.utils.clip_grad_norm_(side.params, self.max_grad_norm))
        if side.scaler is not None:
            side.scaler.step(side.opt)
            side.scaler.update()
            side.skipped += not finite
        elif finite:
            side.opt.step()
        else:
            side.skipped += 1
        side.opt.zero_grad()

    # ------------------------------------------------------------------ comparisons

    def assert_matches_rounded(self) -> None:
        """Weights, state, skipped steps and gradient norm equal to ``rounded``'s: float32 noise.

        Each element may differ by ``NOISE_ULPS`` float32 ulps of the largest magnitude its
        tensor has held per step so far (other kernels computing the same values round
        differently, cancellation can leave a small result next to large terms, and weights and
        state carry each step's difference into the next), and by the relative
        difference of the clipping coefficients, which both sides compute from the norm of the
        same values summed in other orders (twice that: the squared averages); for centered
        RMSprop's weights and momentum, times the cancellation of its variance
        (``_record_cancellation``).
        """
        # GradScaler leaves a float16 optimizer's step to it, but skips bfloat16 ones without
        # calling step(): those skips are not mixedopt's to count (docs/gradscaler.md).
        counted = self.mixed.scaler is None or self.grad_dtype == torch.float16
        assert self.mixed.opt.skipped_steps == (self.rounded.skipped if counted else 0)
        self._record_cancellation()
        for key, mine, theirs in self._pairs(self.rounded):
            mine, theirs = mine.detach(), theirs.detach()
            held = self._held(theirs)
            difference = (mine - theirs).abs()
            rounding = NOISE_ULPS * EPS32 * max(1, self.iterations)  # each step's, carried on
            tolerance = rounding + 2 * self.clipping_noise  # twice: squared averages
            if key in ("weight", "momentum_buffer"):
                tolerance *= self.cancellation
            ok = (difference <= tolerance * held) | (mine == theirs)
            ok |= mine.isnan() & theirs.isnan()
            assert ok.all(), f"{key}: {difference[~ok]} > {tolerance} x {held}"
        stepped = counted or not self.skipped_now  # else GradScaler did not call step()
        if self.max_grad_norm is not None and stepped:
            torch.testing.assert_close(
                self.mixed.opt.last_grad_norm,
                self.rounded.norms[-1],
                rtol=NOISE_ULPS * EPS32,
                atol=0,
                equal_nan=True,
            )

    def _record_cancellation(self) -> None:
        """Centered RMSprop divides by the root of ``square_avg - grad_avg**2``: where the two
        nearly cancel, a rounding of the terms is that many times larger in the difference,
        and so in the step (in the weights, and in the momentum that adds the quotients). The
        largest such factor of the reference's state so far."""
        group = self.rounded.opt.param_groups[0]
        if not group.get("centered"):
            return
        for q in self.rounded.params:
            state = self.rounded.opt.state[q]
            if "grad_avg" in state and q.numel():
                square = state["square_avg"]
                variance = square - state["grad_avg"].square()
                factor = (square / variance.clamp_min(1e-38)).nan_to_num(posinf=0.0).max().item()
                self.cancellation = max(self.cancellation, factor)

    def _held(self, value: Tensor) -> float:
        """The largest magnitude ``value`` (a reference tensor) has held over the run so far."""
        finite = value[value.isfinite()]
        held = max(
            self.held.get(id(value), 0.0), finite.abs().max().item() if finite.numel() else 0.0
        )
        self.held[id(value)] = held
        return held

    def assert_within_rounding_of_exact(self) -> None:
        """Each quantity ``rounding_bounds`` bounds within that bound of ``exact``'s (plus float32
        noise): the documented rounding carried through the update."""
        for (key, mine, theirs), bound in zip(
            self._pairs(self.exact), self.rounding_bounds(), strict=True
        ):
            if bound is None:
                continue
            diff = _max_difference(mine, theirs)
            noise = NOISE_ULPS * EPS32 * _largest(theirs)
            assert diff <= bound + noise, f"{key}: {diff} > {bound} + {noise}"

    def _pairs(self, reference: Side):
        """(name, mixedopt's tensor, the reference's) for each weight, then for its state's."""
        for p, q in zip(self.mixed.params, reference.params, strict=True):
            yield "weight", p, q
            mine, theirs = self.mixed.opt.state[p], reference.opt.state[q]
            assert mine.keys() == theirs.keys()
            for key, value in theirs.items():
                if key == "step":
                    assert float(mine[key]) == float(value)
                    continue
                assert mine[key].dtype == value.dtype == torch.float32
                yield key, mine[key], value

    def rounding_bounds(self) -> list[float | None]:
        """The bound of each quantity of ``_pairs``, in order (``None``: not bounded)."""
        found = []
        for bounds, q in zip(self.bounds, self.exact.params, strict=True):
            found.append(bounds["weight"])
            found += [bounds.get(key) for key in self.exact.opt.state[q] if key != "step"]
        return found

    def _carry_bounds(self) -> None:
        """Carry this iteration's gradient bounds through the update of the parameter's group.

        ``e`` bounds the difference of the gradients the two sides' updates see, ``a`` their
        largest magnitude. A difference ``e`` in a gradient moves a moving average of it by its
        weight times ``e``, and one of its square by its weight times ``(2a + e) e``; SGD's
        weights move by ``lr`` times the difference of their step direction. The other
        optimizers' steps divide element by element (by a root of a squared average, Adamax by
        an infinity norm, Rprop by following signs): an element's step follows its own
        gradients' relative precision, not the tensor's magnitude (where its gradients cancel
        over steps, its error grows with the cancellation), so their weights, and state that
        adds such quotients, get no bound here: ``None``. Weight decay that is added to the
        gradient adds ``weight_decay`` times the weights' difference before the step (measured).
        """
        group = self.exact.opt.param_groups[0]
        name = type(self.exact.opt).__name__
        mine, theirs = self._clip_coefficients()
        for i, q in enumerate(self.exact.params):
            bounds, state = self.bounds[i], self.exact.opt.state[q]
            e = mine * self.gradient_bound[i] + abs(mine - theirs) * self.gradient_largest[i]
            a = theirs * self.gradient_largest[i]
            decoupled = name == "AdamW" or group.get("decoupled_weight_decay", False)
            decay = 0.0 if decoupled else group.get("weight_decay", 0.0)
            e += decay * self.weight_error[i]
            a += decay * self.weight_largest[i]
            if name == "SGD":
                bounds["weight"] = self._sgd_bounds(group, bounds, e, "momentum_buffer" in state)
                continue
            bounds["weight"] = None  # see above
            for key in state:
                if key != "step":
                    bounds[key] = self._state_bound(name, key, group, bounds, e, a)

    @staticmethod
    def _state_bound(name, key, group, bounds, e, a) -> float | None:
        """The bound of a state tensor other than SGD's after this step (``None``: none), from
        ``bounds``, the parameter's bounds so far (this step's for the keys before ``key``)."""
        found = bounds.get(key) or 0.0
        square = (2 * a + e) * e  # what a difference e does to a square of magnitude a
        if key == "exp_avg":  # Adam's, AdamW's, Adamax's, RAdam's: a moving average
            beta1 = group["betas"][0]
            return beta1 * found + (1 - beta1) * e
        if key == "exp_avg_sq":  # Adam's, AdamW's, RAdam's
            beta2 = group["betas"][1]
            return beta2 * found + (1 - beta2) * square
        if key == "max_exp_avg_sq":  # the largest exp_avg_sq so far (this step's comes first)
            return max(found, bounds["exp_avg_sq"])
        if key == "exp_inf":  # Adamax: max(beta2 * u, |g| + eps), 1-Lipschitz in each
            return max(group["betas"][1] * found, e)
        if key == "square_avg":  # RMSprop's (alpha), Adadelta's (rho)
            rate = group["alpha"] if name == "RMSprop" else group["rho"]
            return rate * found + (1 - rate) * square
        if key == "grad_avg":  # RMSprop, centered
            return group["alpha"] * found + (1 - group["alpha"]) * e
        if key == "sum":  # Adagrad: the sum of squares
            return found + square
        # RMSprop's momentum and Adadelta's acc_delta add quotients (see above); Rprop's prev
        # and step sizes follow the gradients' signs.
        return None

    @staticmethod
    def _sgd_bounds(group, bounds, e, has_momentum) -> float:
        """SGD's: the momentum buffer's bound (into ``bounds``), and the weights' (returned)."""
        momentum, dampening = group["momentum"], group["dampening"]
        direction = e
        if has_momentum:
            found = bounds.get("momentum_buffer")
            buffer = e if found is None else momentum * found + (1 - dampening) * e
            bounds["momentum_buffer"] = buffer
            direction = e + momentum * buffer if group["nesterov"] else buffer
        return bounds["weight"] + float(group["lr"]) * direction

    def _clip_coefficients(self, reference: Side | None = None) -> tuple[float, float]:
        """The clipping coefficients of mixed and ``reference`` (``exact`` unless given) at this
        step (1 without clipping)."""
        if self.max_grad_norm is None:
            return 1.0, 1.0
        reference = self.exact if reference is None else reference
        norms = (self.mixed.opt.last_grad_norm.item(), reference.norms[-1].item())
        mine, theirs = (min(1.0, self.max_grad_norm / (n + 1e-6)) for n in norms)
        return mine, theirs


def _max_difference(a: Tensor, b: Tensor) -> float:
    return (a.detach() - b.detach()).abs().max().item() if a.numel() else 0.0


def _largest(t: Tensor) -> float:
    finite = t.detach()[t.detach().isfinite()]
    return finite.abs().max().item() if finite.numel() else 0.0


@st.composite
def scenarios(draw, path: str = "default") -> dict[str, Any]:
    """A training run for ``Trio``: an optimizer and its arguments, parameters, gradients of a
    magnitude per tensor (1e-9 to 1e6) spread over up to 8 decades within it, 1 to 8
    micro-batches an iteration; on the default and fused paths also a GradScaler,
    ``max_grad_norm`` and a step with an inf or NaN gradient."""
    names = [*OPTIMIZERS, *TORCH_FUSED_ONLY] if path == "fused" else EVERY_OPTIMIZER
    name = draw(st.sampled_from(sorted(names)))
    kwargs = draw(hyperparameters(name))
    if path == "fused":
        kwargs["foreach"] = None  # fused and foreach exclude each other, as in torch.optim
    # Muon takes matrices only; Adafactor fails on empty parameters, as torch.optim's does.
    shapes = draw({"Muon": MATRICES, "Adafactor": NON_EMPTY}.get(name, SHAPES))
    steps = draw(st.integers(1, 4))
    scenario = dict(
        name=name,
        kwargs=kwargs,
        shapes=shapes,
        magnitudes=draw(st.lists(st.floats(-9, 6), min_size=len(shapes), max_size=len(shapes))),
        spread=draw(st.sampled_from([0, 3, 8])),
        micro_batches=draw(st.integers(1, 8)),
        steps=steps,
        packing=draw(st.sampled_from([1 << 20, 7, 1, *ACCELERATOR_BUDGETS])),
        grad_dtype=draw(st.sampled_from([torch.float16, torch.float16, torch.bfloat16])),
        seed=draw(st.integers(0, 2**16)),
        loss_scale=None,
        max_grad_norm=None,
        non_finite=None,
    )
    if path != "step_in_backward":  # it refuses GradScaler and max_grad_norm
        scenario["loss_scale"] = draw(st.none() | st.integers(0, 20).map(lambda k: 2.0**k))
        scenario["max_grad_norm"] = draw(st.none() | st.floats(0.01, 10.0))
        where = st.tuples(
            st.integers(0, steps - 1), st.sampled_from([math.inf, -math.inf, math.nan])
        )
        scenario["non_finite"] = draw(st.none() | where)
    return scenario


def run_scenario(s: dict[str, Any], path: str = "default") -> Trio:
    """Train ``s`` (``scenarios``) on a ``Trio``, comparing after every step."""
    generator = torch.Generator().manual_seed(s["seed"])
    initial = [torch.randn(shape, generator=generator) for shape in s["shapes"]]
    trio = Trio(
        s["name"],
        s["kwargs"],
        initial,
        path=path,
        grad_dtype=s["grad_dtype"],
        max_grad_norm=s["max_grad_norm"],
        loss_scale=s["loss_scale"],
    )
    with packing(s["packing"]):
        for step in range(s["steps"]):
            micro_batches = []
            for _ in range(s["micro_batches"]):
                grads = gradient_tensors(s["shapes"], s["magnitudes"], s["spread"], generator)
                micro_batches.append(grads)
            if s["non_finite"] is not None and s["non_finite"][0] == step:
                bad = next((g for g in micro_batches[0] if g.numel()), None)
                if bad is not None:
                    bad.view(-1)[0] = s["non_finite"][1]
            trio.iteration([loss_with_gradients(grads) for grads in micro_batches])
            trio.assert_matches_rounded()
            trio.assert_within_rounding_of_exact()
    return trio
