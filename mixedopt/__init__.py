"""mixedopt: torch.optim optimizers with float32 master weights and 16-bit gradients."""

import warnings

# Without numpy installed, torch's own import warns "Failed to initialize NumPy: No module named
# 'numpy'" (from torch/_subclasses/functional_tensor.py). mixedopt never converts tensors to
# numpy, which is all torch wants numpy for, and the README's set-up installs torch alone:
# `python -m mixedopt` and `python -m mixedopt.bench` import this package, and torch with it,
# before their own code runs, so this is where that one message is kept from their users. Only
# that message, and only when torch is first imported here.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    import torch  # noqa: F401

from ._support import check_torch  # noqa: E402

check_torch()  # a torch that lacks what mixedopt uses fails here, not in the middle of training

from ._autocast import autocast  # noqa: E402
from ._core import MixedPrecisionOptimizer  # noqa: E402
from .adadelta import Adadelta  # noqa: E402
from .adafactor import Adafactor  # noqa: E402
from .adagrad import Adagrad  # noqa: E402
from .adam import Adam  # noqa: E402
from .adamax import Adamax  # noqa: E402
from .adamw import AdamW  # noqa: E402
from .asgd import ASGD  # noqa: E402
from .muon import Muon  # noqa: E402
from .nadam import NAdam  # noqa: E402
from .radam import RAdam  # noqa: E402
from .rmsprop import RMSprop  # noqa: E402
from .rprop import Rprop  # noqa: E402
from .sgd import SGD  # noqa: E402

__all__ = [
    "ASGD",
    "SGD",
    "Adadelta",
    "Adafactor",
    "Adagrad",
    "Adam",
    "AdamW",
    "Adamax",
    "MixedPrecisionOptimizer",
    "Muon",
    "NAdam",
    "RAdam",
    "RMSprop",
    "Rprop",
    "autocast",
]
__version__ = "0.1.0"
