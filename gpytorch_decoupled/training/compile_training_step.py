from __future__ import annotations

from ..models import KernelSelectionGP
from ..optim import RecursiveGradientPropagation
from ..variational import KalmanVariationalStrategy
from .kalman_update_step import KalmanUpdateStep
from .kernel_selection_step import KernelSelectionStep
from .recursive_training_step import RecursiveTrainingStep
from .training_step import TrainingStep


def compile_training_step(
    mll, optimizers=None, *, lean: bool = True, num_data: int | None = None, **compile_options
) -> TrainingStep | RecursiveTrainingStep | KalmanUpdateStep | KernelSelectionStep:
    r"""
    A compiled training step, ``loss = step(x, y)``: ``-mll(model(x), y)`` on the mini-batch, its gradients and every
    optimizer's update in one :func:`torch.compile` graph with no graph break (see
    :class:`~gpytorch_decoupled.training.TrainingStep` for what runs where).

    The Kalman-recursive family's steps compile through the same call, without optimizers:
    ``compile_training_step(srgp)`` for a :class:`~gpytorch_decoupled.optim.RecursiveGradientPropagation` (its whole
    step: bound term, total gradient with the propagated Jacobians, Kalman update, Jacobians of the increments, the
    optimizer's step; :class:`~gpytorch_decoupled.training.RecursiveTrainingStep`, ``psi = step(x, y)`` as
    ``srgp.step(x, y)``) and ``compile_training_step(model.variational_strategy)`` for a
    :class:`~gpytorch_decoupled.variational.KalmanVariationalStrategy` (its ``update(x, y)``;
    :class:`~gpytorch_decoupled.training.KalmanUpdateStep`). Variational Bayesian kernel selection compiles the same
    way: ``compile_training_step(model, adam, num_data=n)`` for a
    :class:`~gpytorch_decoupled.models.KernelSelectionGP` returns its
    :class:`~gpytorch_decoupled.training.KernelSelectionStep` (``local_elbos = step(x, y)``; ``model.fit(...,
    compile=True)`` uses it).

    The first call compiles (tens of seconds on a CPU); from then on a step costs little more than its arithmetic.
    The batch size is a dynamic dimension of that compilation, so a loader's smaller last batch takes the same graph
    (not with ``dynamic=False``, CUDA graphs or SRGP's step, which compile once per new batch size); a new dtype or
    device compiles again, and so do changes of optimizer hyperparameters other than the learning rates, which enter
    the graph as data (learning-rate schedulers do not recompile). Models whose parts the lean path does not support
    (:attr:`TrainingStep.fallback_reason`) train eagerly, with a warning.

    :param mll: The objective, e.g. :class:`gpytorch.mlls.VariationalELBO` (with its model and likelihood), or an SRGP
        object, or a Kalman strategy, or a :class:`~gpytorch_decoupled.models.KernelSelectionGP`.
    :param optimizers: One optimizer or a list (:class:`torch.optim.Adam`, :class:`gpytorch.optim.NGD`); none for SRGP
        (it holds its optimizer) and the Kalman update.
    :param lean: Use the lean training path where supported.
    :param num_data: The number of training points, for a :class:`~gpytorch_decoupled.models.KernelSelectionGP` only
        (the other objectives hold it).
    :param compile_options: Passed to :func:`torch.compile` (``mode="reduce-overhead"`` for CUDA graphs on a GPU,
        ``dynamic`` ...).
    :return: The step.
    :raises TypeError: If optimizers are missing for an objective, or given for SRGP or a Kalman strategy; if
        ``num_data`` is missing for a :class:`~gpytorch_decoupled.models.KernelSelectionGP` or given for anything else.

    Example:
        >>> import gpytorch, torch
        >>> from gpytorch_decoupled.training import compile_training_step
        >>> from gpytorch_decoupled.variational import FastNaturalVariationalDistribution
        >>> class SVGP(gpytorch.models.ApproximateGP):
        ...     def __init__(self, z):
        ...         super().__init__(gpytorch.variational.VariationalStrategy(
        ...             self, z, FastNaturalVariationalDistribution(z.size(0))))
        ...         self.mean_module = gpytorch.means.ZeroMean()
        ...         self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
        ...     def forward(self, x):
        ...         return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))
        >>> x = torch.linspace(-3, 3, 64).unsqueeze(-1)
        >>> y = torch.sin(2 * x.squeeze(-1))
        >>> model, likelihood = SVGP(x[::8].clone()), gpytorch.likelihoods.GaussianLikelihood()
        >>> mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=64)
        >>> ngd = gpytorch.optim.NGD(model.variational_parameters(), num_data=64, lr=0.5)
        >>> adam = torch.optim.Adam([*model.hyperparameters(), *likelihood.parameters()], lr=0.05)
        >>> step = compile_training_step(mll, [ngd, adam], backend="eager")  # "inductor" (the default) is faster
        >>> losses = [step(x, y) for _ in range(20)]
        >>> bool(losses[-1] < losses[0])
        True
    """
    if isinstance(mll, KernelSelectionGP):
        optimizer = optimizers[0] if isinstance(optimizers, (list, tuple)) and len(optimizers) == 1 else optimizers
        if optimizer is None or isinstance(optimizer, (list, tuple)) or num_data is None:
            raise TypeError(
                "compile_training_step(KernelSelectionGP, optimizer, num_data=n) needs one optimizer and n."
            )
        return KernelSelectionStep(mll, optimizer, num_data, compile=True, lean=lean, **compile_options)
    if num_data is not None:
        raise TypeError("num_data is for a KernelSelectionGP; the other objectives hold the number of data.")
    if isinstance(mll, (RecursiveGradientPropagation, KalmanVariationalStrategy)):
        if optimizers is not None:
            raise TypeError(
                f"compile_training_step({type(mll).__name__}) takes no optimizers (SRGP steps its own optimizer; the "
                "Kalman update has none)."
            )
        kind = RecursiveTrainingStep if isinstance(mll, RecursiveGradientPropagation) else KalmanUpdateStep
        return kind(mll, compile=True, lean=lean, **compile_options)
    if optimizers is None:
        raise TypeError("compile_training_step(mll, optimizers) needs the optimizers to step.")
    return TrainingStep(mll, optimizers, compile=True, lean=lean, **compile_options)
