from __future__ import annotations

from torch import Tensor

from ._collectives import Group, all_reduce_sum


def all_reduce_local_elbos(model, x: Tensor, y: Tensor, batch_size: int = 1024, group: Group = None) -> Tensor:
    r"""
    The optimized local ELBOs :math:`\mathcal L^*_c` of a
    :class:`~gpytorch_decoupled.models.KernelSelectionGP` over data sharded across ranks: each rank sums the expected
    log-likelihood over its shard (:meth:`~gpytorch_decoupled.models.KernelSelectionGP.summed_local_elbo_terms`), one
    all-reduce adds the shards, and the KL (the same on every rank) is subtracted once,

    .. math::

        \mathcal L^*_c = \sum_r\sum_{i \in \mathcal D_r}\mathbb E_{q(f_i)}[\log p(y_i \mid f_i, \theta_c)]
            - \mathrm{KL}[q(u_c) \Vert p(u_c)],

    so every rank stores the single-process value and then fits the same :math:`q(g)` with
    :meth:`~gpytorch_decoupled.models.KernelSelectionGP.fit_kernel_belief`. An error or non-finite value on any rank
    raises :class:`~gpytorch_decoupled.distributed.DistributedStepError` on every rank, and nothing is stored.

    :param model: The kernel-selection model (the same state on every rank, e.g. trained with
        :class:`~gpytorch_decoupled.distributed.GradientAllReduce`).
    :param x: This rank's shard of the inputs, ``(n_r, d)``.
    :param y: This rank's shard of the targets, ``(n_r,)``.
    :param batch_size: Block size of the pass over the shard.
    :param group: The process group (default: the world).
    :return: :math:`\mathcal L^*_c`, shape ``(C,)``, also stored in the model.

    Example:
        >>> import torch, torch.distributed as dist
        >>> from gpytorch_decoupled.distributed import all_reduce_local_elbos, init_process_group
        >>> from gpytorch_decoupled.models import KernelSelectionGP
        >>> device = init_process_group()  # a group of one outside torchrun
        >>> x, y = torch.linspace(0, 1, 20).unsqueeze(-1), torch.zeros(20)
        >>> model = KernelSelectionGP(["SE", "LIN"], inducing_points=x[::4].clone())
        >>> torch.allclose(all_reduce_local_elbos(model, x, y), model.estimate_local_elbos(x, y))
        True
        >>> dist.destroy_process_group()
    """
    expected_log_likelihood, kl, failure = None, None, None
    try:
        expected_log_likelihood, kl = model.summed_local_elbo_terms(x, y, batch_size)
    except (ValueError, RuntimeError) as error:
        failure = error
    total = all_reduce_sum(
        expected_log_likelihood,
        model.num_candidates,
        like=model.local_elbo_estimates,
        what="all_reduce_local_elbos",
        group=group,
        failure=failure,
    )
    return model.store_local_elbos(total - kl)
