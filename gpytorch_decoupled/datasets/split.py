from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import overload

from torch import Tensor


@dataclass(frozen=True, eq=False)
class Split:
    r"""
    One train/test split of a benchmark data set, standardized with statistics of its training part only.

    Inputs are mapped to :math:`(\mathbf x - \boldsymbol\mu_x) / \boldsymbol\sigma_x` and regression targets to
    :math:`(y - \mu_y) / \sigma_y`, where :math:`\mu` and :math:`\sigma` are the mean and the population standard
    deviation (``unbiased=False``, so the training part has exactly zero mean and unit standard deviation) of the
    training rows. A column that is constant on the training rows gets :math:`\sigma = 1`. Classification targets
    are float 0/1 labels (the :class:`~gpytorch.likelihoods.BernoulliLikelihood` convention) and are left as they
    are: their :attr:`y_mean` is 0 and :attr:`y_std` is 1.

    Iterating over a split yields ``(train_x, train_y, test_x, test_y)``, so it unpacks like a tuple.

    :param train_x: Standardized training inputs, shape ``[n_train, d]``.
    :param train_y: Training targets, shape ``[n_train]`` (or ``[n_train, t]`` for a set with ``t`` outputs).
    :param test_x: Standardized test inputs, shape ``[n_test, d]``.
    :param test_y: Test targets, standardized with the training statistics.
    :param name: Canonical name of the data set.
    :param task: ``"regression"`` or ``"classification"``.
    :param split: Index of the split.
    :param source: Which copy of the data and which published splits were used (e.g. ``"gal"`` or ``"evans"``).
    :param x_mean: Training mean of the raw inputs, shape ``[d]``.
    :param x_std: Training standard deviation of the raw inputs, shape ``[d]``.
    :param y_mean: Training mean of the raw targets, shape ``[]`` (or ``[t]``).
    :param y_std: Training standard deviation of the raw targets, shape ``[]`` (or ``[t]``).

    Example:
        >>> import torch
        >>> from gpytorch_decoupled import datasets
        >>> data = datasets.load("elevators", split=0)
        >>> train_x, train_y, test_x, test_y = data
        >>> pred_mean, pred_var = torch.zeros_like(test_y), torch.ones_like(test_y)  # stand-in for a model's
        >>> mean, var = data.unstandardize_y(pred_mean, pred_var)
        >>> rmse = (mean - data.unstandardize_y(test_y)).square().mean().sqrt()
    """

    train_x: Tensor = field(repr=False)
    train_y: Tensor = field(repr=False)
    test_x: Tensor = field(repr=False)
    test_y: Tensor = field(repr=False)
    name: str
    task: str
    split: int
    source: str
    x_mean: Tensor = field(repr=False)
    x_std: Tensor = field(repr=False)
    y_mean: Tensor = field(repr=False)
    y_std: Tensor = field(repr=False)

    def __iter__(self) -> Iterator[Tensor]:
        return iter((self.train_x, self.train_y, self.test_x, self.test_y))

    @overload
    def unstandardize_y(self, mean: Tensor, var: None = None) -> Tensor: ...

    @overload
    def unstandardize_y(self, mean: Tensor, var: Tensor) -> tuple[Tensor, Tensor]: ...

    def unstandardize_y(self, mean: Tensor, var: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        r"""
        Map standardized target values (or a predictive mean and variance) back to the original units.

        The mean becomes :math:`\mu_y + \sigma_y m` and the variance :math:`\sigma_y^2 v`. A Gaussian negative log
        predictive density computed in standardized units therefore differs from the one in original units by
        :math:`\log \sigma_y` per output; computing it from the returned mean and variance gives the latter directly.

        :param mean: Standardized values (targets or a predictive mean), broadcastable against :attr:`y_mean`.
        :param var: (Default: None) A predictive variance in standardized units.
        :return: The mean in original units, or ``(mean, var)`` in original units when ``var`` is given.
        :raises TypeError: If ``mean`` or ``var`` is not a floating point tensor.
        """
        for argument, value in (("mean", mean), ("var", var)):
            if value is not None and not (isinstance(value, Tensor) and value.is_floating_point()):
                kind = f"{value.dtype} tensor" if isinstance(value, Tensor) else type(value).__name__
                raise TypeError(f"{argument} must be a floating point torch.Tensor, got a {kind}.")
        mean = mean * self.y_std + self.y_mean
        if var is None:
            return mean
        return mean, var * self.y_std.square()
