"""
BoTorch as a client (the optional ``botorch`` extra: ``pip install "gpytorch_decoupled[botorch]"``): a
:class:`SingleTaskVariationalGP` that builds every strategy of this package the way BoTorch builds GPyTorch's, and
:func:`fit_variational_mll`, the fitting routine that BoTorch's ``fit_gpytorch_mll`` calls for it (closed-form
E-steps for the dual strategy, absorption plus hyperparameter steps for the Kalman strategy).
"""

try:
    import botorch  # noqa: F401
except ModuleNotFoundError as error:  # the extra is optional: say how to get it
    raise ModuleNotFoundError(
        'gpytorch_decoupled.botorch needs BoTorch: pip install "gpytorch_decoupled[botorch]"', name=error.name
    ) from error

from .fit_variational_mll import fit_variational_mll
from .single_task_variational_gp import SingleTaskVariationalGP

__all__ = ["SingleTaskVariationalGP", "fit_variational_mll"]
