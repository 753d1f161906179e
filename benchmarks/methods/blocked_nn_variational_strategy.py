from __future__ import annotations

import gpytorch
import torch
from torch import Tensor


def sequential_nearest_neighbors(points: Tensor, k: int, block_size: int = 512) -> Tensor:
    r"""For each point :math:`i \ge k`, the indices of its ``k`` nearest points among :math:`0, \dots, i - 1`
    (nearest first), ``(M - k, k)``: the neighbour structure of a VNNGP prior (Wu et al., 2022), computed in blocks of
    rows with one distance matrix per block, :math:`O(M^2 d)` work and :math:`O(\text{block} \cdot M)` memory.

    :param points: ``M x d`` inducing points.
    :param k: Neighbours per point.
    :param block_size: Rows per distance block.

    Example:
        >>> sequential_nearest_neighbors(torch.tensor([[0.0], [1.0], [3.0], [0.4]]), k=2).tolist()
        [[1, 0], [0, 1]]
    """
    num_points = points.size(-2)
    neighbors = torch.empty(num_points - k, k, dtype=torch.long, device=points.device)
    for start in range(k, num_points, block_size):
        stop = min(start + block_size, num_points)
        distances = torch.cdist(points[start:stop], points[:stop])
        rows = torch.arange(start, stop, device=points.device).unsqueeze(-1)
        columns = torch.arange(stop, device=points.device)
        distances.masked_fill_(columns >= rows, float("inf"))  # only earlier points are candidates
        neighbors[start - k : stop - k] = distances.topk(k, dim=-1, largest=False).indices
    return neighbors


class BlockedNNVariationalStrategy(gpytorch.variational.NNVariationalStrategy):
    r"""
    GPyTorch's :class:`~gpytorch.variational.NNVariationalStrategy`, unchanged except for how its sequential neighbour
    structure is built: without the optional ``faiss`` library GPyTorch fits one scikit-learn index per inducing point
    (:math:`M` fits, hours at :math:`M = 40{,}000`); :func:`sequential_nearest_neighbors` gives the same neighbours
    from blocked distance matrices in seconds. Non-batched inducing points only.
    """

    def _compute_nn(self) -> BlockedNNVariationalStrategy:
        with torch.no_grad():
            points = self.inducing_points.data.float()
            self.nn_util.set_nn_idx(points)
            self.nn_xinduce_idx = sequential_nearest_neighbors(points, self.k)
        return self
