from __future__ import annotations

import math

import torch
from gpytorch.kernels import Kernel, MaternKernel, RBFKernel, ScaleKernel
from gpytorch.lazy import LazyEvaluatedKernelTensor
from torch import Tensor

from ._squared_distance_kernel_matvec import squared_distance_kernel_matvec
from ._squared_distance_quadratic_form import squared_distance_quadratic_form
from .subnormal_floor import exponent_floor
from .thin_cross_product import thin_cross_product

_LN_2 = math.log(2.0)


class LeanKernel:
    r"""
    The covariance of a GPyTorch kernel of a supported type as plain tensor operations: the same values and gradients
    as the kernel's :class:`~linear_operator.operators.LinearOperator` output (GPyTorch's expansion of the squared
    distances, operation for operation; a kernel value below about :math:`10^{-30}` in float32, :math:`10^{-246}` in
    float64, is raised to it and has no gradient, as in the tiled sweeps: smaller ones are slow subnormal numbers on a
    CPU), read from the kernel's own parameters at every call (no copy is kept),
    without the lazy-tensor and kernel-call layers that block :func:`torch.compile` and cost more than the arithmetic at
    :math:`M \approx 200` (about 0.8 ms of a 2 ms kernel evaluation of :math:`\mathbf K_{\mathbf u[\mathbf u;
    \mathbf x]}` with its diagonal, forward and backward, at :math:`M = 100`, :math:`B = 200`). The compiled
    training steps (:func:`~gpytorch_decoupled.training.compile_training_step`) evaluate every kernel block with
    it, and every strategy's eager forward pass its dense blocks and diagonals
    (:meth:`~gpytorch_decoupled.variational.JointPrior.dense`).

    Supported: :class:`~gpytorch.kernels.RBFKernel` and :class:`~gpytorch.kernels.MaternKernel`
    (:math:`\nu \in \{\tfrac12, \tfrac32, \tfrac52\}`), with one or ARD length-scales, optionally inside a
    :class:`~gpytorch.kernels.ScaleKernel`, without batch shape and active dimensions. Anything else makes
    :meth:`of` return None (the caller keeps GPyTorch's general path). Built directly, a kernel with a batch shape
    ``(k,)`` gives ``(k, N1, N2)`` blocks and ``(k, N)`` diagonals (the SE leaves of
    :class:`~gpytorch_decoupled.training.LeanCandidateBank`; :meth:`matvec` and :meth:`quadratic_form` take no batch).

    .. math::

        k_\mathrm{RBF}(\mathbf x, \mathbf x') = \sigma^2 \exp(-\tfrac12 r^2), \qquad
        k_{\nu=5/2}(\mathbf x, \mathbf x') = \sigma^2 (1 + \sqrt5 r + \tfrac53 r^2) \exp(-\sqrt5 r), \qquad
        r = \lVert \Lambda^{-1}(\mathbf x - \mathbf x') \rVert.

    :param base: The stationary kernel (RBF or Matérn).
    :param scale: The :class:`~gpytorch.kernels.ScaleKernel` around it, or None.

    Example:
        >>> import gpytorch, torch
        >>> kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=2))
        >>> lean = LeanKernel.of(kernel)
        >>> x1, x2 = torch.randn(4, 2), torch.randn(3, 2)
        >>> torch.allclose(lean(x1, x2), kernel(x1, x2).to_dense(), atol=1e-6)
        True
        >>> LeanKernel.of(gpytorch.kernels.LinearKernel()) is None
        True
    """

    def __init__(self, base: Kernel, scale: ScaleKernel | None = None):
        self.base = base
        self.scale = scale

    @classmethod
    def of(cls, kernel: Kernel) -> LeanKernel | None:
        """The lean form of ``kernel``, or None where it is not of a supported type."""
        scale = None
        if type(kernel) is ScaleKernel:
            if kernel.active_dims is not None:
                return None
            scale, kernel = kernel, kernel.base_kernel
        if type(kernel) not in (RBFKernel, MaternKernel) or kernel.active_dims is not None:
            return None
        if type(kernel) is MaternKernel and kernel.nu not in (0.5, 1.5, 2.5):
            return None
        # A scale kernel's batch shape is broadcast with its base kernel's: one look covers both.
        if (scale or kernel).batch_shape != torch.Size([]):
            return None
        return cls(kernel, scale)

    @classmethod
    def of_block(cls, covariance) -> tuple[LeanKernel, Tensor, Tensor] | None:
        r"""
        The lean form of a lazy kernel block, with its inputs :math:`(\mathbf x_1, \mathbf x_2)`: where
        ``covariance`` is GPyTorch's :class:`~gpytorch.lazy.LazyEvaluatedKernelTensor` of a supported kernel (what
        ``covar_module(x)`` returns in a model's ``forward``) without extra kernel arguments, its rows and columns
        are those of the kernel evaluated here at rows of :math:`\mathbf x_1` and of :math:`\mathbf x_2`; None for
        anything else (a dense or composite covariance, another kernel, ``last_dim_is_batch``).
        """
        if type(covariance) is not LazyEvaluatedKernelTensor or covariance.last_dim_is_batch or covariance.params:
            return None
        kernel = cls.of(covariance.kernel)
        return None if kernel is None else (kernel, covariance.x1, covariance.x2)

    def __call__(self, x1: Tensor, x2: Tensor) -> Tensor:
        r""":math:`\mathbf K_{\mathbf x_1\mathbf x_2}`, dense, ``(N1, N2)`` (pass the same tensor twice for a symmetric
        block)."""
        lengthscale = self.base.lengthscale
        # GPyTorch treats equal arguments as one set of points (it zeroes the rounding residual of their diagonal
        # distances where no gradient is taken); a compiled graph cannot compare values, so there only the same tensor.
        same = x1 is x2 or (not torch.compiler.is_compiling() and x1.shape == x2.shape and bool(torch.equal(x1, x2)))
        if type(self.base) is RBFKernel:
            # Compiled (the lean training step): gradients by thin_cross_product, the same sums in another order and
            # several times faster; eager calls keep GPyTorch's product and its rounding.
            thin = torch.compiler.is_compiling()
            limit = _distance_limit(x1.dtype, 0.5)
            squares = expanded_square_distance(x1.div(lengthscale), x2.div(lengthscale), same, thin, limit)
            covariance = squares.mul(-0.5).exp()
        else:
            centre = x1.mean(dim=-2, keepdim=True)
            z1, z2 = (x1 - centre).div(lengthscale), (x2 - centre).div(lengthscale)
            nu = self.base.nu
            limit = _distance_limit(x1.dtype, math.sqrt(2.0 * nu))
            if same:
                # GPyTorch's clamp: the distance of a point to itself has a zero (not infinite) gradient.
                # The square root amplifies the rounding of the diagonal's zero distances, so their gradients need
                # GPyTorch's own product, summed in its order.
                distance = expanded_square_distance(z1, z2, True, False, limit**2).clamp_min(1e-30).sqrt()
            else:  # as GPyTorch's distance between different sets of points
                distance = torch.cdist(z1, z2).clamp(1e-15, limit)
            covariance = torch.exp(-math.sqrt(2.0 * nu) * distance)
            if nu == 1.5:
                covariance = covariance * (math.sqrt(3.0) * distance + 1.0)
            elif nu == 2.5:
                covariance = covariance * (math.sqrt(5.0) * distance + 1.0 + 5.0 / 3.0 * distance.pow(2))
        return covariance if self.scale is None else covariance * self.scale.outputscale[..., None, None]

    @property
    def profile(self) -> str | None:
        """The kernel's profile for the tiled kernel sweeps of :mod:`gpytorch_decoupled.linalg` (``"rbf"``,
        ``"matern32"``, ``"matern52"``), or None for Matérn 1/2, which they do not fuse."""
        if type(self.base) is RBFKernel:
            return "rbf"
        return {1.5: "matern32", 2.5: "matern52"}.get(self.base.nu)

    def matvec(self, x1: Tensor, x2: Tensor, coefficients: Tensor) -> Tensor:
        r"""
        :math:`\mathbf K_{\mathbf x_1\mathbf x_2}\mathbf a`. Eagerly as the general path computes it for the kernels
        it fuses (:func:`~gpytorch_decoupled.linalg.kernel_matvec` of a lazy kernel block: swept in cache-sized tiles,
        forward and backward, no :math:`N_1 \times N_2` array in memory); in a compiled graph, and for Matérn 1/2, the
        dense product (Inductor fuses the block's evaluation with the product).
        """
        profile = self.profile
        if profile is None or torch.compiler.is_compiling():
            return self(x1, x2) @ coefficients
        outputscale = None if self.scale is None else self.scale.outputscale
        return squared_distance_kernel_matvec(x1, x2, coefficients, self.base.lengthscale, outputscale, profile)

    def quadratic_form(self, x: Tensor, coefficients: Tensor) -> Tensor:
        r"""
        :math:`\mathbf a^\top\mathbf K_{\mathbf x\mathbf x}\mathbf a` as the general path computes it
        (:func:`~gpytorch_decoupled.linalg.kernel_quadratic_form` of a lazy kernel block): one sweep over the tiles on
        and above the diagonal, with the gradients reduced in the same sweep, for the kernels it fuses; the dense
        product for the others.
        """
        profile = self.profile
        if profile is None:
            return (coefficients * (self(x, x) @ coefficients)).sum(-1)
        outputscale = None if self.scale is None else self.scale.outputscale
        lengthscale = self.base.lengthscale
        return squared_distance_quadratic_form(
            x, x, coefficients, coefficients, lengthscale, outputscale, profile, True
        )

    def diagonal(self, x: Tensor) -> Tensor:
        r""":math:`k(\mathbf x_n, \mathbf x_n)`, ``(N,)``: the output scale (1 without a scale kernel)."""
        ones = x.new_ones(x.shape[:-1])
        return ones if self.scale is None else ones * self.scale.outputscale[..., None]


def _distance_limit(dtype: torch.dtype, rate: float) -> float:
    r"""The distance :math:`r` at which :math:`e^{-\text{rate}\cdot r}` reaches the kernel tiles' floor
    (:func:`~gpytorch_decoupled.linalg.exponent_floor`): distances are clamped to it, in the clamp the
    expansion needs anyway, so that no kernel value, and no product of one in the backward pass, is a slow subnormal
    number."""
    return -_LN_2 * exponent_floor(dtype) / rate


def expanded_square_distance(z1: Tensor, z2: Tensor, same: bool, thin: bool, limit: float) -> Tensor:
    r"""
    The squared distances :math:`\lVert\mathbf z_{1,i} - \mathbf z_{2,j}\rVert^2` by GPyTorch's expansion, operation
    for operation (centred on the mean of ``z1``, one product of augmented inputs), clamped to ``[0, limit]``: at zero
    distance the result is a rounding residual, which a Matérn kernel's square root amplifies to ~1e-8, so the lean
    paths round exactly as the general path does to return the same values. Batch dimensions broadcast.

    :param z1: ``(..., N1, D)``.
    :param z2: ``(..., N2, D)``.
    :param same: Whether the two are one set of points: as GPyTorch, the diagonal is zeroed where no gradient is taken.
    :param thin: Form the product by :func:`~gpytorch_decoupled.linalg.thin_cross_product` (faster gradients).
    :param limit: The clamp's upper end (``math.inf`` for none).
    :return: ``(..., N1, N2)``.
    """
    adjustment = z1.mean(-2, keepdim=True)
    z1, z2 = z1 - adjustment, z2 - adjustment
    norm1, norm2 = z1.pow(2).sum(dim=-1, keepdim=True), z2.pow(2).sum(dim=-1, keepdim=True)
    augmented1 = torch.cat([-2.0 * z1, norm1, torch.ones_like(norm1)], dim=-1)
    augmented2 = torch.cat([z2, torch.ones_like(norm2), norm2], dim=-1)
    square = thin_cross_product(augmented1, augmented2) if thin else augmented1 @ augmented2.mT
    if same and not z1.requires_grad and not z2.requires_grad:
        square = square - torch.diag_embed(square.diagonal(dim1=-2, dim2=-1))
    return square.clamp(0.0, limit)
