from __future__ import annotations

import torch
from torch import Tensor


def initial_inducing_points(train_x: Tensor, num_inducing: int, seed: int) -> Tensor:
    """A random subset of the training inputs (seeded, so every method of a run starts from the same points).

    :param train_x: Training inputs, ``n x d``.
    :param num_inducing: How many points to draw (at most ``n``).
    :param seed: Seed of the draw.
    """
    if not 0 < num_inducing <= train_x.size(0):
        raise ValueError(
            f"num_inducing must be in [1, {train_x.size(0)}] (the number of training rows), got {num_inducing}"
        )
    generator = torch.Generator().manual_seed(seed)
    index = torch.randperm(train_x.size(0), generator=generator)[:num_inducing]
    return train_x[index.to(train_x.device)].clone()
