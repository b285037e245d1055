"""``MixedPrecisionOptimizer``: the mixin placed before a ``torch.optim`` class.

Construction and the checks of parameters and groups, copying and pickling, the public extras
(``remove_grad_storage``, ``true_grad``, ``step_in_backward``, ``skipped_steps``), ``step()``, and
the rules an optimizer file implements (``_state_keys``, ``_init_state``, ``_update``, the
compiled kernel). The stages of its step are a component it owns (``_stages.StepStages``).
See docs/design.md, "The step".
"""

from __future__ import annotations

import itertools
import operator
import warnings
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, cast

import torch
from torch import Tensor
from torch.optim.optimizer import _device_dtype_check_for_fused

from ._choice import Implementation, fused_requested, implementation
from ._distributed import is_dtensor
from ._eager import compiled_autograd_is_on
from ._entries import Entry
from ._in_backward import InBackwardState, UpdatingBackward, grad_scaler_error
from ._reference_step import user_stacklevel
from ._rules import UpdateRules
from ._stages import StepStages
from ._storage import SUPPORTED_GRAD_DTYPES, GradientStorage
from ._workspace import Workspace

_UNSUPPORTED_FLAGS = ("capturable", "differentiable")
_dtype_of = operator.attrgetter("dtype")


class MixedPrecisionOptimizer(torch.optim.Optimizer):
    """Float32 master weights and state, 16-bit gradients; mixed into a ``torch.optim`` class.

    At construction every parameter (it must be float32) gets what makes its ``.grad`` land in
    ``grad_dtype`` after ``backward()``: in float16 the true gradient times a per-tensor
    power-of-two storage scale (``true_grad`` undoes it), in bfloat16 the true gradient. Several
    optimizers may hold a parameter; its storage goes with the last. ``step()`` upcasts and
    unscales the gradients in bounded batches and applies the parent's float32 update to float32
    weights and state.

    Args:
        params: the parameters to optimize, or dicts defining parameter groups, as for the
            ``torch.optim`` class; every parameter must be float32.
        *args: the ``torch.optim`` class's other positional arguments.
        grad_dtype: dtype of the stored gradients, ``torch.float16`` (default) or
            ``torch.bfloat16``.
        max_grad_norm: if set, ``step()`` clips the true gradients of all parameter groups to this
            global L2 norm, as ``torch.nn.utils.clip_grad_norm_`` would on float32 gradients.
        **kwargs: the ``torch.optim`` class's other keyword arguments.

    Attributes:
        grad_dtype: dtype of the stored gradients.
        max_grad_norm: the clipping norm, or ``None``.
        last_grad_norm: with ``max_grad_norm``, the L2 norm of all true gradients (before
            clipping) at the last ``step()`` that had gradients, a 0-dim float32 tensor;
            ``None`` before that and without ``max_grad_norm``.
        skipped_steps: steps skipped because a gradient was inf or NaN (GradScaler's included
            with float16 gradients; with bfloat16 ones GradScaler skips without calling step()).
            Reading it after fused steps on an accelerator synchronises with the device.
    """

    # Whether GradScaler hands step() its scale and found_inf (set per instance, see _set_up).
    _step_supports_amp_scaling: bool

    def __init__(
        self,
        params: Any,
        *args: Any,
        grad_dtype: torch.dtype = torch.float16,
        max_grad_norm: float | None = None,
        **kwargs: Any,
    ) -> None:
        name = type(self).__name__
        if grad_dtype not in SUPPORTED_GRAD_DTYPES:
            raise ValueError(
                f"Invalid grad_dtype: {grad_dtype}; mixedopt.{name} stores gradients in "
                "torch.float16 or torch.bfloat16"
            )
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(
                f"Invalid max_grad_norm value: {max_grad_norm}; use a positive number, or None "
                "for no clipping"
            )
        self._set_up(grad_dtype, max_grad_norm, skipped_steps=0)
        try:
            super().__init__(params, *args, **kwargs)
        except BaseException:
            self.remove_grad_storage()
            raise
        self._step_supports_amp_scaling = grad_dtype == torch.float16  # the parent's fused sets it

    def _set_up(
        self, grad_dtype: torch.dtype, max_grad_norm: float | None, skipped_steps: int
    ) -> None:
        self.grad_dtype = grad_dtype
        self.max_grad_norm = max_grad_norm
        # GradScaler hands float16 optimizers its scale and found_inf (it refuses to unscale
        # float16 gradients itself); bfloat16 gradients hold true values, which GradScaler
        # unscales as it does for torch.optim, so that unscale_() and clipping work as there.
        self._step_supports_amp_scaling = grad_dtype == torch.float16
        self._warned_changed_in_place = False
        self._warned_compiled_autograd = False
        self._in_backward = InBackwardState()  # step_in_backward()'s state
        self.last_grad_norm: Tensor | None = None
        self._skipped_on_host = skipped_steps
        self._skipped_on_device: Tensor | None = None  # fused steps on an accelerator
        self._workspace = Workspace()  # buffers gradients are upcast and parameters packed into
        self._grad_storage = GradientStorage.shared(grad_dtype)
        # The stages of the step see the optimizer through a weak proxy: no reference cycle,
        # so that a dropped optimizer lets go of its parameters at once.
        rules = cast(UpdateRules, weakref.proxy(self))
        self._stages = StepStages(rules, self._grad_storage, self._workspace, type(self).__name__)
        self._held_params: set[int] = set()  # ids of the parameters this optimizer holds
        self._fused_devices_checked: set[int] = set()  # ids of the fused groups checked
        # The storage does not reference the optimizer: its parameters are let go when it dies.
        self._release_storage: weakref.finalize = weakref.finalize(
            self, self._grad_storage.release_when_safe, self._held_params
        )

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["mixedopt"] = {
            "grad_dtype": self.grad_dtype,
            "max_grad_norm": self.max_grad_norm,
            "skipped_steps": self.skipped_steps,
        }
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A copy (``copy.deepcopy``, pickling) stores its own parameters' gradients as well.

        ``load_state_dict`` calls this too, on a set-up optimizer: nothing to set up then.
        """
        settings = state.pop("mixedopt", {})
        super().__setstate__(state)
        if "_grad_storage" in self.__dict__:
            self._workspace.clear()  # its views and aliases hold the replaced state's memory
            return
        self._set_up(
            settings.get("grad_dtype", torch.float16),
            settings.get("max_grad_norm"),
            settings.get("skipped_steps", 0),
        )
        for group in self.param_groups:
            for p in group["params"]:
                self._install(p)

    # ------------------------------------------------------------------ construction

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group, as the parent does, and store its gradients in ``grad_dtype``.

        Args:
            param_group: the group's parameters (``"params"``) and options, as for the parent;
                its parameters are checked as at construction (float32, no ``capturable`` or
                ``differentiable``), and a group that fails is not added.
        """
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            self._check_group(group)
        except ValueError:
            self.param_groups.pop()
            raise
        for p in group["params"]:
            self._install(p)

    def _install(self, param: Tensor) -> None:
        # FSDP2 owns the gradients of its sharded parameters; after remove_grad_storage() this
        # optimizer stores no gradient.
        if not is_dtensor(param) and self._release_storage.alive:
            self._grad_storage.install(param, self._held_params)

    def _check_group(self, group: dict[str, Any]) -> None:
        name = type(self).__name__
        for flag in _UNSUPPORTED_FLAGS:
            if group.get(flag):
                raise ValueError(
                    f"mixedopt.{name} does not support {flag}=True; leave it at its default"
                )
        for p in group["params"]:
            if p.dtype != torch.float32:
                raise ValueError(
                    f"mixedopt.{name} got a parameter of dtype {p.dtype}; mixedopt keeps float32 "
                    "master weights, so every parameter must be torch.float32 (keep the model in "
                    "float32 and use torch.autocast for low-precision compute)"
                )
            if p.is_inference():
                raise ValueError(
                    f"mixedopt.{name} got a parameter created under torch.inference_mode(): "
                    "autograd keeps no node to hook for it, and it cannot be updated in place "
                    "outside inference mode; create the parameters outside inference mode"
                )
            self._grad_storage.check_can_manage(p)

    def _check_fused_devices(self) -> None:
        """Raise torch's error for ``fused=True`` on a device it has no fused kernels for.

        At a ``fused=True`` group's first step with gradients, before anything is updated, as
        torch.optim raises it at the first step (the compiled kernels and torch's fused updates
        run on the same devices). A group that failed is checked again at the next step, after
        its parameters moved, say.
        """
        for group in self.param_groups:
            if not fused_requested(group) or id(group) in self._fused_devices_checked:
                continue
            with_grad = [p for p in group["params"] if p.grad is not None]
            for p in with_grad:
                _device_dtype_check_for_fused(p)
            if with_grad:
                self._fused_devices_checked.add(id(group))

    def remove_grad_storage(self) -> None:
        """Stop storing gradients in ``grad_dtype`` for this optimizer's parameters.

        Removes the hooks installed at construction and gives every parameter its true float32
        gradient back: from then on the parameters behave like plain torch parameters, and
        parameters added later are left alone. The optimizer still steps (on float32 gradients).
        A parameter that another mixedopt optimizer also holds keeps its storage until that one
        lets go too. Also done when the optimizer is garbage collected (inside a trace, on a
        thread other than the main one or during the storage's work, at the next safe point:
        see "What ``p.grad`` holds" in the documentation).
        """
        self._in_backward.storage_removed = True
        if self._release_storage.detach() is not None:
            self._grad_storage.release(self._held_params)

    def true_grad(self, param: Tensor) -> Tensor | None:
        """The gradient of ``param`` without the storage scale, as a new float32 tensor.

        It is the gradient of what was backpropagated: after ``scaler.scale(loss).backward()``
        it still holds GradScaler's loss scale.

        Args:
            param: a parameter of this optimizer.

        Returns:
            The true gradient of ``param``, float32; ``None`` where there is no gradient.
        """
        return self._grad_storage.true_grad(param)

    def step_in_backward(self) -> AbstractContextManager[object]:
        """A context in which ``backward()`` updates the weights as it produces the gradients.

        ``with optimizer.step_in_backward(): loss.backward()`` does what ``loss.backward();
        optimizer.step(); optimizer.zero_grad()`` does, with the same weights and state, but the
        parameters are updated inside backward as soon as their stored gradients reach 4Mi
        elements together (or backward ends), and those gradients are freed
        then: the gradients of the whole model are never held. For gradient accumulation, the
        earlier micro-batches run a plain ``loss.backward()`` (their gradients are stored in 16
        bits as usual) and the last one runs in this context.

        When it ends it calls ``step()`` once: that updates the parameters that got no gradient
        in this backward but hold one from earlier micro-batches, runs the step hooks, and is
        what LR schedulers check for. After it every parameter's ``.grad`` is ``None``, so a
        ``step()`` or ``zero_grad()`` that follows does nothing.

        An inf or NaN gradient stops the updates of this backward: the parameters updated
        before it keep their update, the others keep their weights and state, their gradients
        are discarded, a ``RuntimeWarning`` says how many of each, and ``skipped_steps`` counts
        it. Refused with a ``RuntimeError``: ``max_grad_norm`` and GradScaler (both need every
        gradient before the first update; GradScaler is caught at its ``step()``, after the
        backward), DistributedDataParallel and FSDP2 (they own the gradients), parameters
        another mixedopt optimizer holds, and ``remove_grad_storage()``.

        Returns:
            The context manager; it may be entered again.

        Example:
            ```python
            import torch
            import mixedopt

            model = torch.nn.Linear(8, 2)
            optimizer = mixedopt.AdamW(model.parameters(), lr=1e-3)
            loss = model(torch.randn(4, 8)).square().mean()
            with optimizer.step_in_backward():
                loss.backward()  # updates the weights and frees the gradients
            assert model.weight.grad is None
            ```
        """
        return UpdatingBackward(
            self, self._grad_storage, self._in_backward, self._update_in_backward
        )

    def _update_in_backward(self, by_group: list[list[Tensor]]) -> bool:
        """For ``step_in_backward()``: update ``by_group``'s parameters as ``step()`` would.

        Args:
            by_group: a list per param group of parameters whose gradients backward has just
                stored.

        Returns:
            False, having updated nothing, where a gradient is inf or NaN; True otherwise.
        """
        self._check_dtypes(by_group)
        collected = self._stages.collect(by_group, self.max_grad_norm)  # as step() takes them
        if not collected:
            return True
        scaling = self._stages.scaling(collected, None, None, self.max_grad_norm, on_host=True)
        if scaling.read_skip():
            return False
        self._stages.update(collected, scaling)
        return True

    # ------------------------------------------------------------------ step

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because a gradient was inf or NaN.

        GradScaler's skips are included with float16 gradients; with bfloat16 ones GradScaler
        skips without calling ``step()``.
        """
        on_device = 0 if self._skipped_on_device is None else int(self._skipped_on_device.item())
        return self._skipped_on_host + self._in_backward.skipped + on_device

    # Excluded from torch.compile (``torch.compile(optimizer.step)`` runs it eagerly, a graph
    # break): dynamo traces parameters as fake tensors without the ``grad_dtype = None`` that
    # lets a float32 parameter hold a 16-bit .grad. ``fused=True`` is the compiled step.
    @torch.compiler.disable(
        reason="mixedopt's step() runs eagerly under torch.compile: its parameters hold 16-bit "
        ".grad tensors that dynamo cannot trace; use fused=True for a compiled step"
    )
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Perform a single optimization step; see the parent class.

        Unscales the stored gradients (storage scale, GradScaler's scale, ``max_grad_norm``
        clipping) and applies the parent's update in float32. The whole step is skipped, weights
        and state untouched, when GradScaler found an inf/NaN or when any gradient is non-finite.

        Args:
            closure: a function that reevaluates the model and returns the loss, as for the
                parent (run with gradients enabled); optional.

        Returns:
            The closure's loss, or ``None`` without a closure.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # 0. What a backward left waiting in a bucket (one that raised, or ended early).
        self._grad_storage.flush()
        grad_scale = getattr(self, "grad_scale", None)  # GradScaler's, during its step()
        found_inf = getattr(self, "found_inf", None)
        self._check_before_step(found_inf)
        # 1. What a step updates: the whole buckets, and the other gradients as entries.
        stages = self._stages
        collected = stages.collect(None, self.max_grad_norm)
        if not collected:
            return loss
        if not self._warned_changed_in_place and self.grad_dtype == torch.float16:
            self._warned_changed_in_place = stages.reference.warn_if_changed_in_place(
                collected.entries()
            )
        if not self._warned_compiled_autograd and compiled_autograd_is_on():
            self._warn_if_hooks_were_traced(collected.entries())
        # 2. Each gradient's factor to its true value, and the skip on inf or NaN.
        scaling = stages.scaling(collected, grad_scale, found_inf, self.max_grad_norm)
        if scaling.grad_norm is not None:
            self.last_grad_norm = scaling.grad_norm
        if not scaling.read_skip():
            # 3. The update, batch by batch: whole buckets, then each group's entries.
            stages.update(collected, scaling)
            if scaling.on_device:
                self._count_skip_on_device(scaling.skip)
            return loss

        self._skipped_on_host += 1
        if found_inf is None:  # with GradScaler, skipping is routine: no warning
            warnings.warn(
                f"mixedopt.{type(self).__name__}: a gradient is inf or NaN; the step was "
                f"skipped (weights and state unchanged; {self.skipped_steps} skipped so far)",
                RuntimeWarning,
                stacklevel=user_stacklevel(),
            )
        return loss

    def _count_skip_on_device(self, skip: Tensor) -> None:
        """Add a skip that fused steps on an accelerator decided on the device (no host read)."""
        if self._skipped_on_device is None:
            self._skipped_on_device = torch.zeros((), dtype=torch.int64, device=skip.device)
        self._skipped_on_device += skip

    def _check_before_step(self, found_inf: Tensor | None) -> None:
        """What ``step()`` refuses before it collects anything."""
        self._check_fused_devices()
        self._check_dtypes(self.param_groups)
        running = self._grad_storage.held_by_other_backwards(self._held_params)
        if running:
            raise RuntimeError(
                f"mixedopt.{type(self).__name__}.step(): a backward still running (on another "
                f"thread) holds the gradient of {running} of its parameter(s), not stored yet; "
                "wait for that backward to end (join its thread) before step(), as torch.optim "
                "needs too"
            )
        if self._in_backward.updated:
            self._in_backward.updated = False
            # GradScaler found no gradient: the backward had used them, scaled.
            if found_inf is not None and not torch.is_tensor(found_inf):
                raise grad_scaler_error(self)

    def _check_dtypes(self, groups: list[Any]) -> None:
        """Refuse parameters that are no longer float32 (``model.half()`` after construction).

        ``groups`` holds parameter groups (dicts) or lists of parameters. One pass in C per
        group in the common case, where every parameter is float32.
        """
        for index, group in enumerate(groups):
            params = group["params"] if isinstance(group, dict) else group
            if all(map(operator.is_, map(_dtype_of, params), itertools.repeat(torch.float32))):
                continue
            changed = next(p for p in params if p.dtype != torch.float32)
            name = type(self).__name__
            raise RuntimeError(
                f"mixedopt.{name}: a parameter of group {index} is now {changed.dtype}; it was "
                "float32 when the optimizer was built (model.half() or .to(dtype) after "
                "construction?). mixedopt keeps float32 master weights: convert the model back "
                "with model.float(), or build the optimizer after converting it, and use "
                "torch.autocast for low-precision compute"
            )

    def _warn_if_hooks_were_traced(self, entries: list[Entry]) -> None:
        """Warn once when compiled autograd left float32 gradients on parameters it manages.

        Compiled autograd traces the backward into one graph, where the storage's hooks are
        traced as doing nothing: the gradients reach ``step()`` in float32 (true values, and
        the steps are right), and no memory is saved. Only gradients that did arrive so say
        so: with the flag on but the gradients stored in 16 bits, nothing is said.
        """
        storage = self._grad_storage
        if not any(
            e.grad.dtype == torch.float32
            and e.param in storage
            and not storage.left_to_engine(e.param)  # DDP's stay float32 by design
            and not e.sharded
            for e in entries
        ):
            return
        self._warned_compiled_autograd = True
        warnings.warn(
            "mixedopt: compiled autograd traced the backward into one graph, where mixedopt "
            "leaves the gradients float32 until "
            "step(): the steps are right, but no gradient memory is saved. Turn it off to have "
            f"the gradients stored in {self.grad_dtype}.",
            UserWarning,
            stacklevel=user_stacklevel(),
        )

    # ------------------------------------------------------------------ per optimizer

    # The compiled update of one parameter or one pack (``_compiled.py``), its state arguments
    # in order, whether the parent's functional update has a fused implementation, and whether
    # its foreach implementation makes fewer temporaries than its for-loop (``_choice.py``).
    _compiled_kernel: Callable[..., None] | None = None  # None: fused=True takes torch's own
    _compiled_state_order: tuple[str, ...] = ()
    _parent_has_torch_fused = False
    _foreach_fewer_temporaries = False

    def _compiled_hyperparameters(self, group: dict[str, Any]) -> list[Tensor | bool | None]:
        """The arguments of the compiled kernel that a group shares, after the skip flag."""
        raise NotImplementedError

    def _compiled_coefficients(self, group: dict[str, Any], steps: Tensor) -> list[Tensor]:
        """Coefficients per parameter that depend on its step counter (Adam's bias corrections).

        Each is a 1-D tensor like ``steps``.
        """
        return []

    # Whether the update needs each parameter whole: Adafactor's factors of a matrix's rows and
    # columns, Muon's orthogonalisation of it. Such parameters are never cut into pieces.
    _updates_whole_parameters = False

    def _created_by_update(self, group: dict[str, Any]) -> list[str]:
        """State keys the functional update creates itself, rather than ``_init_state``.

        SGD's momentum buffer, a copy of the first gradient.
        """
        return []

    def _state_keys(self, group: dict[str, Any]) -> list[str]:
        """Float32 state tensors the update reads for this group, in order.

        Elementwise, or 0-dim scalars of a parameter (NAdam's ``mu_product``), which advance
        once per parameter as its step counter does.
        """
        raise NotImplementedError

    def _init_state(self, param: Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        """Create the parent's state for ``param`` on its first step, as the parent does.

        A step counter and zeros for every state key (RMSprop, Adam); SGD overrides it.
        """
        if len(state) != 0:
            return
        # Like torch.optim.Adam(fused=True), a fused optimizer keeps its step on the device.
        device = param.device if fused_requested(group) else None
        state["step"] = torch.zeros((), dtype=torch.float32, device=device)
        for key in self._state_keys(group):
            state[key] = torch.zeros_like(param, memory_format=torch.preserve_format)

    def _torch_implementation(self, group: dict[str, Any], params: list[Tensor]) -> Implementation:
        """Which of torch's implementations ``_update`` calls for ``params`` (``_choice.py``)."""
        return implementation(
            group,
            params,
            torch_fused=self._parent_has_torch_fused,
            compiled=False,
            foreach_fewer_temporaries=self._foreach_fewer_temporaries,
        )

    def _torch_foreach(self, group: dict[str, Any], params: list[Tensor]) -> bool | None:
        """``foreach`` for a functional update that has no fused implementation."""
        return self._torch_implementation(group, params).functional_kwargs()["foreach"]

    def _update(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        states: dict[str, list[Tensor | None]],
        steps: list[Tensor],
        found_inf: Tensor | None = None,
    ) -> None:
        """Apply the parent's functional update to float32 ``grads`` (slices of the parameters).

        Its fused implementation for a ``fused=True`` group, where the parent has one; with
        ``found_inf`` (a 0-dim float tensor), a fused update that changes nothing where it is
        set.
        """
        raise NotImplementedError
