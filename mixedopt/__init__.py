"""mixedopt: torch.optim optimizers with float32 master weights and 16-bit gradients."""

from ._core import MixedPrecisionOptimizer
from .adam import Adam
from .adamw import AdamW
from .rmsprop import RMSprop
from .sgd import SGD

__all__ = ["SGD", "Adam", "AdamW", "MixedPrecisionOptimizer", "RMSprop"]
__version__ = "0.1.0"
