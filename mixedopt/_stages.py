"""The stages of ``step()`` over its three paths: collect, factors and skip, update.

``StepStages``, a component of the optimizer, owns the reference path (``ReferencePath``), the
whole-bucket path (``WholeBucketPath``) and the ``fused=True`` path (``FusedPath``), and runs
each stage over them. It keeps no state of the optimizer: what a stage finds (the gradient
norm, a skip decided on the device) goes back to it in ``Scaling``. See docs/design.md, "The
step".
"""

from __future__ import annotations

from typing import Any, NamedTuple

from torch import Tensor

from ._bucket_step import WholeBucketPath
from ._bucket_store import WholeBucket
from ._budget import budget
from ._entries import Entry
from ._fused_step import FusedPath
from ._reference_step import ReferencePath
from ._rules import UpdateRules
from ._storage import GradientStorage
from ._workspace import Workspace


class Collected(NamedTuple):
    """What a step updates: the whole buckets, and the other gradients per group, as entries."""

    buckets: list[WholeBucket]
    steps: list[tuple[dict[str, Any], list[Entry]]]

    def __bool__(self) -> bool:
        return bool(self.buckets or self.steps)

    def entries(self) -> list[Entry]:
        """The entries of every group, in order."""
        return [e for _, group_entries in self.steps for e in group_entries]


class Scaling(NamedTuple):
    """Each gradient's factor to its true value, and whether the step is skipped."""

    factors: Tensor | None  # one per entry, in order
    # No loss scale and no clipping: the factor of a gradient of true values is exactly 1.
    unscaled: bool
    bucket_unscale: Tensor | None  # GradScaler's and clipping's, for the whole buckets
    skip: Tensor  # 0-dim bool: a gradient is inf or NaN, or GradScaler found one
    fused: bool  # every group takes the fused=True path
    on_device: bool  # the skip is decided on the device (no host read)
    grad_norm: Tensor | None  # with max_grad_norm: the norm of the true gradients, unclipped

    def read_skip(self) -> bool:
        """Whether the step is skipped, read on the host unless decided on the device."""
        # On the CPU reading the flag costs nothing; on an accelerator the fused kernels keep
        # the old values where it is set, without host synchronisation, and the default path
        # synchronises once, here.
        return not self.on_device and bool(self.skip)


class StepStages:
    """The stages of ``step()``; see the module's docstring."""

    def __init__(
        self, rules: UpdateRules, storage: GradientStorage, workspace: Workspace, name: str
    ) -> None:
        self.rules = rules
        self.workspace = workspace
        self.reference = ReferencePath(rules, storage, workspace, name)
        self.whole_buckets = WholeBucketPath(rules, storage, workspace)
        self.fused = FusedPath(rules, workspace, storage.stored_bucket, self.reference.step_group)

    def collect(self, params: list[list[Tensor]] | None, max_grad_norm: float | None) -> Collected:
        """What a step updates: the whole buckets, and the other gradients per group.

        Among ``params`` (a list per parameter group; ``None``: all of them).
        """
        buckets, left = self.whole_buckets.take(params, max_grad_norm)
        if left == 0:  # every gradient is in a whole bucket
            return Collected(buckets, [])
        taken = {id(param) for bucket in buckets for param in bucket.params}
        groups = self.rules.param_groups
        if params is None:
            params = [group["params"] for group in groups]
        steps = [
            (group, self.reference.entries(chosen, taken))
            for group, chosen in zip(groups, params, strict=True)
        ]
        return Collected(buckets, [(group, entries) for group, entries in steps if entries])

    def scaling(
        self,
        collected: Collected,
        grad_scale: Tensor | None,
        found_inf: Tensor | None,
        max_grad_norm: float | None,
        on_host: bool = False,
    ) -> Scaling:
        """Each gradient's factor to its true value, and whether the step is skipped.

        Skipped, nothing changed, when GradScaler's ``found_inf`` is set or a gradient is inf
        or NaN. The default path reads that flag on the host (``Scaling.read_skip``): on an
        accelerator, the one host synchronisation of a step (torch's foreach and for-loop
        updates cannot skip on the device). Fused steps on an accelerator decide it on the
        device unless ``on_host``: no synchronisation.
        """
        buckets, steps = collected
        entries = collected.entries()
        skips, factors, unscale, norm = [], None, None, None
        if entries:
            factors, skip, norm = self.reference.factors_and_skip(
                entries, grad_scale, found_inf, max_grad_norm
            )
            skips.append(skip)
        if buckets:
            unscale, skip = self.whole_buckets.factors_and_skip(buckets, grad_scale, found_inf)
            skips.append(skip)
        skip = skips[0] if len(skips) == 1 else skips[0] | skips[1].to(skips[0].device)
        bucket_groups = set().union(*(bucket.groups for bucket in buckets))
        groups = self.rules.param_groups
        fused = all(self.fused.takes(group, chosen) for group, chosen in steps) and all(
            self.fused.takes(groups[index], []) for index in bucket_groups
        )
        on_device = fused and not on_host and not budget(skip.device).on_host
        unscaled = grad_scale is None and max_grad_norm is None
        return Scaling(factors, unscaled, unscale, skip, fused, on_device, norm)

    def update(self, collected: Collected, scaling: Scaling) -> None:
        """Update the whole buckets, then each group's entries, with ``scaling``'s factors.

        The workspace's buffers go back to the allocator at its end: nothing of the update's
        size stays between steps.
        """
        buckets, steps = collected
        device_skip = scaling.skip if scaling.on_device else None
        try:
            if buckets:
                self.whole_buckets.update(buckets, scaling.bucket_unscale, device_skip)
            start = 0
            for group, group_entries in steps:
                assert scaling.factors is not None
                group_factors = scaling.factors[start : start + len(group_entries)]
                start += len(group_entries)
                if scaling.fused:
                    self.fused.step_group(group, group_entries, group_factors, device_skip)
                else:
                    self.reference.step_group(group, group_entries, group_factors, scaling.unscaled)
        finally:
            self.workspace.release()
