r"""
Compiled training steps: :func:`compile_training_step` captures a whole step (forward, ELBO, backward, optimizer
updates) in one :func:`torch.compile` graph, through a lean tensor path with the values and gradients of GPyTorch's
general path (:class:`LeanELBO`, :class:`~gpytorch_decoupled.linalg.LeanKernel`, :class:`LeanLikelihood`, and
t-SVGP's E-step :class:`LeanEStep`); :func:`eager_training_step` is the eager step it equals. The Kalman-recursive
family's steps, SRGP's (:class:`RecursiveTrainingStep`) and the Kalman update (:class:`KalmanUpdateStep`), compile
through the same helper, from the lean prior blocks :class:`LeanKalmanBlocks`; VBKS's step over all its candidates
is :class:`KernelSelectionStep` (the candidate bank by :class:`LeanCandidateBank`). The documentation's guide on
compiling says what is supported and what falls back to eager.
"""

from ..linalg import LeanKernel as LeanKernel  # moved to linalg; importable here as before
from . import lean_strategies, optimizer_updates
from .compile_training_step import compile_training_step
from .eager_training_step import eager_training_step
from .kalman_update_step import KalmanUpdateStep
from .kernel_selection_step import KernelSelectionStep
from .lean_candidate_bank import LeanCandidateBank
from .lean_e_step import LeanEStep
from .lean_elbo import LeanELBO
from .lean_kalman_blocks import LeanKalmanBlocks
from .lean_likelihood import LeanLikelihood
from .lean_local_elbos import LeanLocalELBOs
from .recursive_training_step import RecursiveTrainingStep
from .training_step import TrainingStep

__all__ = [
    "KalmanUpdateStep",
    "KernelSelectionStep",
    "LeanCandidateBank",
    "LeanELBO",
    "LeanEStep",
    "LeanKalmanBlocks",
    "LeanLikelihood",
    "LeanLocalELBOs",
    "RecursiveTrainingStep",
    "TrainingStep",
    "compile_training_step",
    "eager_training_step",
    "lean_strategies",
    "optimizer_updates",
]
