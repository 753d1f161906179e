"""GPflow's SVGP step for ``bench compiled-step``, run by the interpreter of a separate environment with GPflow 2.11
and TensorFlow (``--gpflow-python``; never imported by the project): ``python gpflow_svgp.py CONFIG DATA SECONDS
WARMUP`` with CONFIG ``gpflow-svgp-adam`` or ``gpflow-svgp-natgrad-adam``. The same model as the PyTorch
configurations (whitened SVGP, ARD squared-exponential kernel with an output scale, Gaussian likelihood, float32),
the same data, inducing inputs and batch order; the step is a ``tf.function``. Prints the same JSON line as
``benchmarks/compiled_step_worker.py``."""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import gpflow  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402
from timing import time_steps  # noqa: E402  (this folder, on sys.path as the script's)


def main(config: str, data_path: str, seconds: float, warmup: int) -> dict:
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    gpflow.config.set_default_float(np.float32)
    data = np.load(data_path)
    x, y = data["train_x"].astype(np.float32), data["train_y"].astype(np.float32)[:, None]
    kernel = gpflow.kernels.SquaredExponential(lengthscales=np.ones(x.shape[1], np.float32))
    model = gpflow.models.SVGP(
        kernel, gpflow.likelihoods.Gaussian(), data["inducing"].astype(np.float32).copy(), num_data=len(x), whiten=True
    )
    batches = [(tf.constant(x[index]), tf.constant(y[index])) for index in data["batches"]]
    adam = tf_keras.optimizers.Adam(0.01)
    if config == "gpflow-svgp-natgrad-adam":
        gpflow.set_trainable(model.q_mu, False)
        gpflow.set_trainable(model.q_sqrt, False)
        natgrad = gpflow.optimizers.NaturalGradient(gamma=0.1)

        @tf.function
        def step(xb, yb):
            def loss():
                return model.training_loss((xb, yb))

            natgrad.minimize(loss, [(model.q_mu, model.q_sqrt)])
            adam.minimize(loss, model.trainable_variables)
    elif config == "gpflow-svgp-adam":

        @tf.function
        def step(xb, yb):
            adam.minimize(lambda: model.training_loss((xb, yb)), model.trainable_variables)
    else:
        raise ValueError(f"unknown configuration {config!r}")
    return time_steps(config, lambda i: step(*batches[i % len(batches)]), seconds, warmup)


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]))))
