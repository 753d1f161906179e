"""GPJax's SVGP step for ``bench compiled-step``, run by the interpreter of a separate environment with GPJax 1.0 and
JAX (``--gpjax-python``; never imported by the project): ``python gpjax_svgp.py gpjax-svgp-adam DATA SECONDS WARMUP``.
The same model as the PyTorch configurations (whitened SVGP, ARD squared-exponential kernel with a variance, Gaussian
likelihood, float32), the same data, inducing inputs and batch order; the step (ELBO, gradients, Optax Adam) is one
``jax.jit`` function, as ``gpjax.fit`` builds it. Prints the same JSON line as
``benchmarks/compiled_step_worker.py``."""

import json
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")

import equinox as eqx  # noqa: E402
import gpjax as gpx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from timing import time_steps  # noqa: E402  (this folder, on sys.path as the script's)


def main(config: str, data_path: str, seconds: float, warmup: int) -> dict:
    if config != "gpjax-svgp-adam":
        raise ValueError(f"unknown configuration {config!r}")
    data = np.load(data_path)
    x, y = data["train_x"].astype(np.float32), data["train_y"].astype(np.float32)[:, None]
    kernel = gpx.kernels.RBF(lengthscale=jnp.ones(x.shape[1], jnp.float32), variance=jnp.float32(1.0))
    prior = gpx.gps.Prior(mean_function=gpx.mean_functions.Zero(), kernel=kernel)
    likelihood = gpx.likelihoods.Gaussian(obs_stddev=jnp.float32(1.0))
    model = gpx.variational_families.WhitenedVariationalGaussian(
        model=prior * likelihood, inducing_inputs=jnp.asarray(data["inducing"], jnp.float32)
    )
    batches = [
        gpx.Dataset(X=jnp.asarray(x[index]), y=jnp.asarray(y[index]), n_total=len(x)) for index in data["batches"]
    ]
    optim = optax.adam(0.01)
    opt_state = optim.init(eqx.filter(model, eqx.is_array))

    def loss(model, batch):
        return -gpx.objectives.elbo(model, batch)

    @eqx.filter_jit
    def step(model, opt_state, batch):
        value, grads = eqx.filter_value_and_grad(loss)(model, batch)
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, value

    state = {"model": model, "opt_state": opt_state}

    def run(i: int):
        state["model"], state["opt_state"], value = step(state["model"], state["opt_state"], batches[i % len(batches)])
        return value

    return time_steps(config, run, seconds, warmup, finish=jax.block_until_ready)


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]))))
