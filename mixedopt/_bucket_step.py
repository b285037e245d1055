"""The step of whole buckets: a training loop's small gradients taken as backward stored them.

``WholeBucketPath`` (a component of ``MixedPrecisionOptimizer``) updates the buckets whose
gradients all belong to the optimizer, untouched, with nothing per parameter but its state;
everything else takes the reference path (``_reference_step.py``), which it is tested against
bit for bit.
"""

from __future__ import annotations

import itertools
import operator
from typing import Any

import torch
from torch import Tensor

from ._bucket_store import GroupIndex, WholeBucket
from ._budget import budget
from ._choice import Implementation, fused_requested, implementation
from ._default_step import stored_batches, upcast_stored
from ._rules import UpdateRules
from ._scales import any_non_finite
from ._storage import GradientStorage
from ._workspace import Workspace


class WholeBucketPath:
    """Takes and updates the whole buckets of a step; see the module."""

    def __init__(self, rules: UpdateRules, storage: GradientStorage, workspace: Workspace) -> None:
        self.rules = rules
        self.storage = storage
        self.workspace = workspace
        self.group_index = GroupIndex()  # the group of each parameter

    def take(
        self, params: list[list[Tensor]] | None, max_grad_norm: float | None
    ) -> tuple[list[WholeBucket], int | None]:
        """The buckets this step updates on its own path, and how many gradients it leaves.

        Among ``params`` (a list per parameter group; default: all of them). No bucket, and
        ``None`` left (not looked for), with ``max_grad_norm``. Each bucket taken has the state
        of its parameters.
        """
        if max_grad_norm is not None:
            return [], None  # not looked for: the reference path looks at every gradient
        groups = self.rules.param_groups
        if params is None:
            params = [group["params"] for group in groups]
        self.group_index.refresh(params)
        found, left = self.storage.whole_buckets(self.group_index)
        if not found:
            return [], left
        keys = [frozenset(self.rules._state_keys(group)) for group in groups]
        taken = []
        for bucket in found:
            states = self._states_of(bucket, keys)
            if states is None:
                left += len(bucket.params)  # the reference path takes them
            else:
                bucket.states = states
                taken.append(bucket)
        return taken, left

    def _compiled_takes(self, group: dict[str, Any], params: list[Tensor]) -> bool:
        """Whether the compiled kernels update ``params`` of a ``fused=True`` group."""
        return (
            fused_requested(group)
            and self.rules._compiled_kernel is not None
            and implementation(
                group, params, torch_fused=self.rules._parent_has_torch_fused, compiled=True
            )
            is Implementation.COMPILED
        )

    def _states_of(self, bucket: WholeBucket, keys: list[frozenset[str]]) -> list[Any] | None:
        """The state of each parameter of ``bucket``; ``None`` where the bucket cannot be taken.

        Parameters the compiled kernels update (``fused=True``), and a parameter without its
        state yet (it gets it from its first step), take the reference path. Over a bucket of
        one group (the common case) the checks are passes in C (``map``), not a Python step per
        parameter.
        """
        if len(bucket.groups) > 1:
            return self._states_of_members(bucket, keys)
        (index,) = bucket.groups
        params = bucket.params
        if self._compiled_takes(self.rules.param_groups[index], params):
            return None
        if not keys[index]:  # like the parent, an optimizer without state (SGD) records none
            return [None] * len(params)
        states = list(map(self.rules.state.get, params))
        if any(map(operator.is_, states, itertools.repeat(None))):
            return None
        for key in keys[index]:
            if not all(map(operator.contains, states, itertools.repeat(key))):
                return None
        return states

    def _states_of_members(
        self, bucket: WholeBucket, keys: list[frozenset[str]]
    ) -> list[Any] | None:
        """``_states_of`` for a bucket that spans groups, parameter by parameter."""
        states = []
        for index, param in zip(bucket.indices, bucket.params, strict=True):
            if self._compiled_takes(self.rules.param_groups[index], [param]):
                return None
            if keys[index]:
                found_state = self.rules.state.get(param)
                if found_state is None or not keys[index] <= found_state.keys():
                    return None
                states.append(found_state)
            else:
                states.append(None)
        return states

    def factors_and_skip(
        self, buckets: list[WholeBucket], grad_scale: Tensor | None, found_inf: Tensor | None
    ) -> tuple[Tensor | None, Tensor]:
        """1 / loss scale (``None``: 1), and whether a gradient of ``buckets`` is inf or NaN.

        A bucket's factor per gradient is that over its storage scale (``update``).
        """
        device = buckets[0].rows.stored.device
        unscale = None
        if grad_scale is not None:
            unscale = grad_scale.to(device=device, dtype=torch.float32).reciprocal()
        if found_inf is not None:  # GradScaler checked every gradient already
            return unscale, found_inf.to(device) > 0
        # The whole stats tables, not their bound columns: a storage scale is always finite
        # (``_scales.power_of_two_scale``), so a non-finite value is a bound's; one operation less.
        tables = [bucket.stats for bucket in buckets]
        if len(tables) > 1:
            tables = [torch.cat([table.to(device) for table in tables])]
        return unscale, any_non_finite(tables[0])

    def update(
        self, buckets: list[WholeBucket], unscale: Tensor | None, skip: Tensor | None
    ) -> None:
        """Update the parameters of ``buckets``, in batches of buckets (``budget(device).piece``).

        ``skip`` (on an accelerator, every group fused) goes to torch's fused update as
        ``found_inf``: nothing changes where it is set, without host synchronisation.
        """
        groups = self.rules.param_groups
        keys = [self.rules._state_keys(group) for group in groups]
        piece = budget(buckets[0].rows.stored.device).piece
        for batch in stored_batches([bucket.rows for bucket in buckets], piece):
            chosen = [buckets[i] for i in batch]
            device = chosen[0].rows.stored.device
            stats = chosen[0].stats
            if len(chosen) > 1:
                stats = torch.cat([bucket.stats.to(device) for bucket in chosen])
            # A bfloat16 bucket holds true values (storage scale 1, see
            # ``StorageScales.for_magnitudes``): with no loss scale either, there is nothing to
            # multiply by.
            factors, divisors = None, None
            if unscale is not None:
                factors = unscale.to(device) / stats[:, 0].to(device)
            elif chosen[0].rows.stored.dtype != torch.bfloat16:
                divisors = stats  # divided by the storage scales
            grads = upcast_stored(
                self.workspace, [bucket.rows for bucket in chosen], factors, divisors
            )
            for index, params, group_grads, states in _by_group(chosen, grads):
                group = groups[index]
                states = states if keys[index] else []
                fused = fused_requested(group)
                found = None if skip is None or not fused else skip.to(device).float()
                self.rules._update(
                    group,
                    params,
                    group_grads,
                    {key: list(map(operator.itemgetter(key), states)) for key in keys[index]},
                    [s["step"] for s in states if "step" in s],
                    found_inf=found,
                )


def _by_group(
    buckets: list[WholeBucket], grads: list[Tensor]
) -> list[tuple[int, list[Tensor], list[Tensor], list[Any]]]:
    """``(group index, parameters, gradients, states)`` of each group ``buckets`` span.

    ``grads`` holds the gradients of every bucket, in order. Buckets of one group (the common
    case) are taken as they are, without a step per row.
    """
    groups = set().union(*(bucket.groups for bucket in buckets))
    if len(buckets) == 1:
        params, indices, states = buckets[0].params, buckets[0].indices, buckets[0].states
    else:
        params = [p for bucket in buckets for p in bucket.params]
        indices = [i for bucket in buckets for i in bucket.indices]
        states = [s for bucket in buckets for s in bucket.states]
    if len(groups) == 1:
        (index,) = groups
        # A copy of the list of views: the workspace keeps the one it made.
        return [(index, params, list(grads), states)]
    rows_of: dict[int, list[int]] = {}
    for row, index in enumerate(indices):
        rows_of.setdefault(index, []).append(row)
    return [
        (
            index,
            [params[row] for row in rows],
            [grads[row] for row in rows],
            [states[row] for row in rows],
        )
        for index, rows in rows_of.items()
    ]
