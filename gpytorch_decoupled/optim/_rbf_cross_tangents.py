from __future__ import annotations

import torch
from gpytorch.kernels import RBFKernel, ScaleKernel
from gpytorch.likelihoods import GaussianLikelihood
from gpytorch.models import ApproximateGP
from torch import Tensor
from torch.func import functional_call, jacfwd


class RBFCrossTangents(torch.nn.Module):
    r"""
    Closed-form derivatives of the products :math:`\mathbf K_{\mathbf uk}\mathbf K_{k\mathbf u}` and
    :math:`\mathbf K_{\mathbf uk}\mathbf r_k` of a model whose kernel is a (scaled) squared exponential,
    :math:`k(\mathbf z, \mathbf x) = s\exp(-\tfrac12\sum_d (z_d - x_d)^2/\ell_d^2)`, along directions of its raw
    hyperparameters, its inducing inputs and its likelihood's noise: what
    :class:`~gpytorch_decoupled.optim.RecursiveGradientPropagation` otherwise takes from forward-mode passes through
    the kernel (:ref:`derivations-information-form`). With :math:`\delta_{mid} = Z_{md} - X_{id}`,

    .. math::

        \dot{\mathbf K}_{\mathbf uk} = \mathbf K_{\mathbf uk}\odot\Big(\sum_d\frac{\dot\ell_d}{\ell_d^3}\,
        \boldsymbol\delta_d^{\odot 2} - \sum_d\frac{\dot{\mathbf Z}_{\cdot d}}{\ell_d^2}\odot\boldsymbol\delta_d
        + \frac{\dot s}{s}\Big),

    so every derivative of the two products is a combination of :math:`2D + 1` products computed once per
    mini-batch (:meth:`prepare`): :math:`\mathbf P^{(k)}_d = (\mathbf K_{\mathbf uk}\odot\boldsymbol\delta_d^{\odot k})
    \mathbf K_{k\mathbf u}` and :math:`\mathbf v^{(k)}_d = (\mathbf K_{\mathbf uk}\odot\boldsymbol\delta_d^{\odot k})
    \mathbf r_k` for :math:`k = 1, 2`, and :math:`\mathbf K_{\mathbf uk}\mathbf K_{k\mathbf u}`,
    :math:`\mathbf K_{\mathbf uk}\mathbf r_k`; row :math:`m` of the inducing inputs' term takes row :math:`m` of
    :math:`\mathbf P^{(1)}_d`. The tangents :math:`\dot\ell`, :math:`\dot s` and the noise's :math:`\dot\sigma^2`
    come from the Jacobian of the constrained values in the raw parameters (one forward-mode pass through the
    parameters' transforms alone). The prior mean does not depend on these parameters.

    The formula assumes that the model's ``forward`` is ``MultivariateNormal(mean_module(x), covar_module(x))`` with
    this kernel; its user checks that against a forward-mode pass before relying on it. This module holds the model and
    the likelihood under the names of the caller's module, so that :func:`torch.func.functional_call` swaps the same
    parameter names in both.
    """

    def __init__(
        self,
        model: ApproximateGP,
        likelihood: GaussianLikelihood,
        base: RBFKernel,
        scale: ScaleKernel | None,
        inducing_name: str | None,
    ):
        super().__init__()
        self.model = model
        self.likelihood = likelihood
        # In lists: not second submodule names for the same parameters.
        self._kernels = [base, scale]
        self._inducing_name = inducing_name
        self._prepared: dict[str, Tensor] = {}
        self._jacobians: tuple[dict[str, Tensor], ...] = ()

    @classmethod
    def of(
        cls, model: ApproximateGP, likelihood: GaussianLikelihood, inducing_name: str | None
    ) -> RBFCrossTangents | None:
        """The closed form for ``model``, whose inducing inputs the caller names ``inducing_name`` (None where they are
        not a parameter), or None where its ``covar_module`` is not an RBF kernel, optionally scaled, on all input
        dimensions."""
        kernel, scale = getattr(model, "covar_module", None), None
        if type(kernel) is ScaleKernel and kernel.active_dims is None:
            scale, kernel = kernel, kernel.base_kernel
        if type(kernel) is not RBFKernel or kernel.active_dims is not None:
            return None
        return cls(model, likelihood, kernel, scale, inducing_name)

    def handles(self, name: str) -> bool:
        """Whether the parameter of this name (as the caller's module names it) is one whose tangents this closed form
        gives: the kernel's, the likelihood's and the inducing inputs."""
        return name.startswith(("model.covar_module.", "likelihood.")) or name == self._inducing_name

    def forward(self) -> tuple[Tensor, Tensor, Tensor]:
        """The length-scales ``(*batch, 1, L)``, the output scale ``(*batch,)`` (1 without a scale kernel) and the
        noise variance, as the increments see them."""
        base, scale = self._kernels
        lengthscale = base.lengthscale
        outputscale = lengthscale.new_ones(()) if scale is None else scale.outputscale
        return lengthscale, outputscale, self.likelihood.noise[..., 0]

    def prepare(self, x: Tensor, cross: Tensor, residual: Tensor, chunk_elements: int) -> None:
        r"""
        The products of a mini-batch that :meth:`tangents` combines, at the current parameters (call it before each
        mini-batch's tangents, without autograd).

        :param x: The mini-batch's inputs, ``(*batch, B, D)``.
        :param cross: :math:`\mathbf K_{\mathbf uk}`, ``(*batch, M, B)``.
        :param residual: :math:`\mathbf r_k`, ``(*batch, B, 1)``.
        :param chunk_elements: Elements of the :math:`D\times M\times B` intermediates to hold at once.
        """
        inducing_points = self.model.variational_strategy.inducing_points.detach()
        batch_shape = torch.broadcast_shapes(inducing_points.shape[:-2], x.shape[:-2])
        inducing_points = inducing_points.expand(*batch_shape, *inducing_points.shape[-2:]).movedim(-1, 0)
        x = x.expand(*batch_shape, *x.shape[-2:]).movedim(-1, 0)
        dims, chunk = x.size(0), max(1, chunk_elements // cross.numel())
        # The residual as one more column of the right factor: each product and its vector in one matrix product.
        right = torch.cat([cross, residual.mT.expand(*cross.shape[:-2], 1, cross.size(-1))], dim=-2).mT
        parts: list[list[Tensor]] = [[], []]
        for start in range(0, dims, chunk):
            difference = inducing_points[start : start + chunk].unsqueeze(-1) - x[start : start + chunk].unsqueeze(-2)
            weighted = cross
            for power in range(2):
                weighted = weighted * difference
                parts[power].append(weighted @ right)
        first, second, plain = torch.cat(parts[0]), torch.cat(parts[1]), cross @ right
        self._prepared = {
            "first": first[..., :-1],
            "second": second[..., :-1],
            "first_vector": first[..., -1],
            "second_vector": second[..., -1],
            "square": plain[..., :-1],
            "vector": plain[..., -1],
        }
        primals = {
            name: parameter.detach()
            for name, parameter in self.named_parameters()
            if self.handles(name) and name != self._inducing_name
        }

        def constrained(values: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
            return functional_call(self, values, ())

        self._jacobians = jacfwd(constrained)(primals) if primals else ()

    def tangents(self, tangents: dict[str, Tensor]) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        r"""
        Along ``c`` directions (``tangents`` maps names of parameters this closed form :meth:`handles` to their
        directions, ``(c, *parameter.shape)``), the derivatives of :math:`\mathbf K_{\mathbf uk}\mathbf K_{k\mathbf u}`
        (``(c, *batch, M, M)``, not symmetrized), of :math:`\mathbf K_{\mathbf uk}\mathbf r_k` (``(c, *batch, M)``) and
        of the noise variance (``(c, *noise)``), at the mini-batch of the last :meth:`prepare`; None for each that no
        direction moves.
        """
        tangents = dict(tangents)
        inducing_tangent = tangents.pop(self._inducing_name, None)
        prepared = self._prepared
        values = tuple(value.detach() for value in self())
        lengthscale, outputscale, _ = values
        products = vectors = noise_tangent = None

        def add(product: Tensor, vector: Tensor) -> None:
            nonlocal products, vectors
            products = product if products is None else products + product
            vectors = vector if vectors is None else vectors + vector

        if tangents:
            lengthscale_tangent, outputscale_tangent, noise_tangent = (
                sum(
                    (
                        jacobian[name].reshape(value.numel(), -1) @ direction.reshape(direction.size(0), -1).mT
                    ).mT.reshape(direction.size(0), *value.shape)
                    for name, direction in tangents.items()
                )
                for jacobian, value in zip(self._jacobians, values, strict=True)
            )
            if lengthscale_tangent.any():
                weights = lengthscale_tangent / lengthscale.pow(3)
                weights = weights.expand(*weights.shape[:-1], prepared["second"].size(0))
                add(
                    torch.einsum("c...d,d...->c...", weights.unsqueeze(-2), prepared["second"]),
                    torch.einsum("c...d,d...->c...", weights, prepared["second_vector"]),
                )
            if outputscale_tangent.any():
                relative = (outputscale_tangent / outputscale)[..., None]
                add(relative.unsqueeze(-1) * prepared["square"], relative * prepared["vector"])
            noise_tangent = noise_tangent if noise_tangent.any() else None
        if inducing_tangent is not None and inducing_tangent.any():
            weights = inducing_tangent / lengthscale.pow(2)
            add(
                -torch.einsum("c...d,d...->c...", weights.unsqueeze(-2), prepared["first"]),
                -torch.einsum("c...d,d...->c...", weights, prepared["first_vector"]),
            )
        return products, vectors, noise_tangent
