"""AdamW with float32 master weights and 16-bit gradients."""

from __future__ import annotations

import torch

from .adam import Adam

__all__ = ["AdamW"]


class AdamW(Adam, torch.optim.AdamW):
    """:class:`torch.optim.AdamW` with float32 master weights and 16-bit gradients.

    Takes every argument of the parent, with the same defaults, plus the keyword-only
    ``grad_dtype`` and ``max_grad_norm``: see :class:`mixedopt.MixedPrecisionOptimizer`.
    """
