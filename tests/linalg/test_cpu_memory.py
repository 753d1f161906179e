"""keep_freed_cpu_memory: freed blocks stay in glibc's heap (no page faults for the next step's temporaries), once per
process, never against the user's choice."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap

import pytest

from gpytorch_decoupled.linalg import cpu_memory, keep_freed_cpu_memory

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
needs_glibc = pytest.mark.skipif(not GLIBC, reason="the allocator settings exist only with glibc")

# Page faults per training step of a decoupled model (M_alpha = 1000, M_beta = 200, batches of 256: its natural step
# allocates and frees M_beta x M_alpha blocks, about a megabyte each). glibc maps blocks of at least its mmap threshold
# from the system and trims free memory above its trim threshold; both start at 128 KiB and rise, as blocks are freed,
# only as far as the history of the process has taken them, so how many of a step's blocks are mapped afresh varies
# from process to process (56 to 2,100 faults a step measured with the defaults). The reference run therefore pins the
# initial thresholds (GLIBC_TUNABLES, which keep_freed_cpu_memory leaves alone): every such block faults every step.
_FAULTS = textwrap.dedent(
    """
    import json, resource, gpytorch, torch
    from gpytorch_decoupled.linalg import cpu_memory, keep_freed_cpu_memory
    from gpytorch_decoupled.optim import MeanBasisAdam
    from gpytorch_decoupled.variational import DecoupledVariationalDistribution, DecoupledVariationalStrategy
    {setup}
    if not {train}:
        print(json.dumps({{"applied": cpu_memory._applied}}))
        raise SystemExit
    torch.manual_seed(0)
    x = torch.rand(2048, 8)
    y = torch.sin(x.sum(-1))
    class Model(gpytorch.models.ApproximateGP):
        def __init__(self):
            q = DecoupledVariationalDistribution(1000, 200)
            super().__init__(DecoupledVariationalStrategy(self, x[:200].clone(), q, x[1000:2000].clone()))
            self.mean_module = gpytorch.means.ZeroMean()
            self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=8))
        def forward(self, z):
            return gpytorch.distributions.MultivariateNormal(self.mean_module(z), self.covar_module(z))
    model, likelihood = Model(), gpytorch.likelihoods.GaussianLikelihood()
    mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=2048)
    mean_step = MeanBasisAdam(model)
    coefficients = model.variational_strategy.mean_basis.coefficients
    others = [p for p in [*model.parameters(), *likelihood.parameters()] if p is not coefficients]
    optimizers = [mean_step, torch.optim.Adam(others, lr=0.01)]
    def step(i):
        rows = slice(256 * (i % 8), 256 * (i % 8 + 1))
        for optimizer in optimizers:
            optimizer.zero_grad()
        (-mll(model(x[rows]), y[rows])).backward()
        for optimizer in optimizers:
            optimizer.step()
    for i in range(8):
        step(i)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for i in range(10):
        step(i)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10
    print(json.dumps({{"faults": faults, "applied": cpu_memory._applied}}))
    """
)


def _run(setup: str = "", train: bool = True, **environment: str) -> dict:
    env = {
        key: value for key, value in os.environ.items() if key not in ("GLIBC_TUNABLES", cpu_memory.OPT_OUT_VARIABLE)
    }
    env.update(environment)
    code = _FAULTS.format(setup=textwrap.dedent(setup), train=train)
    output = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(output.stdout.strip().splitlines()[-1])


@needs_glibc
def test_freed_blocks_are_reused_without_page_faults():
    initial = "glibc.malloc.mmap_threshold=131072:glibc.malloc.trim_threshold=131072"
    returned = _run(GLIBC_TUNABLES=initial)
    kept = _run()  # the mean basis applies it
    assert returned["applied"] is None
    assert kept["applied"] == {"trim_threshold": 512 * 2**20, "mmap_threshold": 32 * 2**20}
    assert returned["faults"] > 1000  # megabyte blocks mapped and unmapped every step
    assert kept["faults"] < 100  # at most the pages of the heap's growth to a new high-water mark


@needs_glibc
def test_the_first_settings_stay():
    setup = """
        first = keep_freed_cpu_memory(2**28, 2**24)
        assert keep_freed_cpu_memory() == first == {"trim_threshold": 2**28, "mmap_threshold": 2**24}
    """
    assert _run(setup, train=False)["applied"] == {"trim_threshold": 2**28, "mmap_threshold": 2**24}


@needs_glibc
@pytest.mark.parametrize(
    "environment",
    [{cpu_memory.OPT_OUT_VARIABLE: "0"}, {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1000000"}],
    ids=["opted-out", "user-tunables"],
)
def test_leaves_the_allocator_alone_when_told(environment):
    result = _run("assert keep_freed_cpu_memory() is None", train=False, **environment)
    assert result["applied"] is None


@needs_glibc
def test_training_steps_and_mean_bases_apply_it():
    build = """
        import gpytorch
        from gpytorch_decoupled.variational import OrthogonallyDecoupledVariationalStrategy
        class Model(gpytorch.models.ApproximateGP):
            def __init__(self):
                q = gpytorch.variational.NaturalVariationalDistribution(4)
                beta, gamma = torch.randn(4, 1), torch.randn(9, 1)
                super().__init__(OrthogonallyDecoupledVariationalStrategy(self, beta, q, gamma))
                self.mean_module, self.covar_module = gpytorch.means.ZeroMean(), gpytorch.kernels.RBFKernel()
        assert cpu_memory._applied is None
        Model()
        assert cpu_memory._applied is not None
    """
    assert _run(build, train=False)["applied"] is not None
    # TrainingStep applies it first thing, before it even reads the objective.
    step = """
        from gpytorch_decoupled.training import TrainingStep
        try:
            TrainingStep(None, [])
        except AttributeError:
            pass
        assert cpu_memory._applied is not None
    """
    assert _run(step, train=False)["applied"] is not None


def test_does_nothing_without_glibc(monkeypatch):
    monkeypatch.setattr(cpu_memory, "_applied", None)
    monkeypatch.setattr(cpu_memory.platform, "libc_ver", lambda: ("", ""))
    assert keep_freed_cpu_memory() is None
    assert cpu_memory._applied is None


@pytest.mark.parametrize(
    "arguments",
    [{"trim_threshold": 0}, {"mmap_threshold": 2**25 + 1}, {"trim_threshold": 2**31}, {"mmap_threshold": 1.5}],
)
def test_rejects_bad_thresholds_before_anything(monkeypatch, arguments):
    monkeypatch.setattr(cpu_memory, "_applied", None)
    with pytest.raises(ValueError, match="threshold"):
        keep_freed_cpu_memory(**arguments)
    assert cpu_memory._applied is None
