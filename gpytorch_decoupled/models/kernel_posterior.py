from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


class KernelPosterior(Sequence):
    r"""
    The kernel posterior :math:`q^*(\kappa_c)` of VBKS as a table sorted by probability, most probable first: each
    row is ``(name, probability)``, and :attr:`indices` maps the rows back to the candidates' positions in the model.
    ``str()`` prints the table.

    :param names: Candidate names, in the model's order.
    :param probabilities: :math:`q^*(\kappa_c)` in the model's order, shape ``(C,)``.

    Example:
        >>> import torch
        >>> from gpytorch_decoupled.models import KernelPosterior
        >>> posterior = KernelPosterior(["SE", "PER", "SE + PER"], torch.tensor([0.2, 0.1, 0.7], dtype=torch.float64))
        >>> posterior[0]
        ('SE + PER', 0.7)
        >>> posterior.indices.tolist()
        [2, 0, 1]
        >>> print(posterior.top(2))
        rank  probability  kernel
           1       0.7000  SE + PER
           2       0.2000  SE
    """

    def __init__(self, names: Sequence[str], probabilities: Tensor, indices: Tensor | None = None):
        probabilities = torch.as_tensor(probabilities).detach().cpu()
        if probabilities.shape != (len(names),):
            raise ValueError(f"got {len(names)} names but probabilities of shape {tuple(probabilities.shape)}.")
        order = torch.argsort(probabilities, descending=True, stable=True)
        self.names = [names[i] for i in order.tolist()]
        self.probabilities = probabilities[order]
        self.indices = order if indices is None else torch.as_tensor(indices)[order]

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, row):
        if isinstance(row, slice):
            return [self[i] for i in range(len(self))[row]]
        return self.names[row], float(self.probabilities[row])

    def top(self, k: int) -> KernelPosterior:
        """The ``k`` most probable rows (probabilities as they are, not renormalized)."""
        return KernelPosterior(self.names[:k], self.probabilities[:k], self.indices[:k])

    def as_dict(self) -> dict[str, float]:
        """``{name: probability}``, most probable first."""
        return dict(self[:])

    def __str__(self) -> str:
        rows = [
            f"{rank:>4}  {float(p):>11.4f}  {name}"
            for rank, (name, p) in enumerate(zip(self.names, self.probabilities), 1)
        ]
        return "\n".join(["rank  probability  kernel", *rows])

    def __repr__(self) -> str:
        head = ", ".join(f"{name!r}: {float(p):.3g}" for name, p in zip(self.names[:3], self.probabilities[:3]))
        more = ", ..." if len(self) > 3 else ""
        return f"KernelPosterior({{{head}{more}}})"
