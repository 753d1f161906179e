r"""
Compiled training steps: :func:`compile_training_step` captures a whole step (forward, ELBO, backward, optimizer
updates) in one :func:`torch.compile` graph, through a lean tensor path with the values and gradients of GPyTorch's
general path (:class:`LeanELBO`, :class:`LeanKernel`, :class:`LeanLikelihood`, and t-SVGP's E-step
:class:`LeanEStep`); :func:`eager_training_step` is the eager step it equals. The documentation's guide on compiling
says what is supported and what falls back to eager.
"""

from . import lean_strategies, optimizer_updates
from .compile_training_step import compile_training_step
from .eager_training_step import eager_training_step
from .lean_e_step import LeanEStep
from .lean_elbo import LeanELBO
from .lean_kernel import LeanKernel
from .lean_likelihood import LeanLikelihood
from .training_step import TrainingStep

__all__ = [
    "LeanELBO",
    "LeanEStep",
    "LeanKernel",
    "LeanLikelihood",
    "TrainingStep",
    "compile_training_step",
    "eager_training_step",
    "lean_strategies",
    "optimizer_updates",
]
