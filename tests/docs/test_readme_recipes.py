"""The README's recipes run as written: each is the first ``python`` block after its heading, executed with the names
its text says it is given."""

from __future__ import annotations

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[2] / "README.md"


def recipe(heading: str) -> str:
    """The first ``python`` code block after the Markdown heading ``heading``."""
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n{heading}\n")
    return re.search(r"```python\n(.*?)```", text[start:], re.DOTALL).group(1)


def test_the_tsvgp_recipe_trains_with_the_default_schedule():
    # Given train_x, N and a loader (three epochs of shuffled mini-batches of 50 of a smooth 2-D function), the recipe's
    # loop moves the sites and the hyperparameters, the E-step size follows max(1/t, 0.1), and the ELBO rises.
    generator = torch.Generator().manual_seed(0)
    train_x = torch.rand(400, 2, generator=generator) * 4 - 2
    train_y = torch.sin(2 * train_x[:, 0]) * torch.cos(train_x[:, 1]) + 0.1 * torch.randn(400, generator=generator)
    N = train_x.size(0)
    loader = [
        (train_x[index], train_y[index]) for _ in range(3) for index in torch.randperm(N, generator=generator).split(50)
    ]
    torch.manual_seed(0)
    namespace = {"train_x": train_x, "N": N, "loader": loader[:1]}
    exec(recipe("### Dual parameterization (t-SVGP)"), namespace)  # one step: the ELBO after it is the baseline
    model, likelihood, objective = namespace["model"], namespace["likelihood"], namespace["objective"]

    def elbo() -> float:
        model.train(), likelihood.train()
        with torch.no_grad():
            return float(objective(model(train_x), train_y))

    first = elbo()
    namespace["loader"] = loader[1:]
    loop = recipe("### Dual parameterization (t-SVGP)")
    exec(loop[loop.index("for x_batch, y_batch in loader:") :], namespace)  # the rest of the loader
    assert elbo() > first + 0.05
    steps = len(loader)
    assert namespace["e_step"].param_groups[0]["lr"] == max(1 / (steps + 1), 0.1)
    site_mean, site_precision = model.variational_strategy._variational_distribution()
    assert site_mean.abs().sum() > 0 and torch.linalg.eigvalsh(site_precision).min() > -1e-6
