import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# One fixed profile for every property-based test: the same examples on every run and machine (derandomized, no
# example database), no per-example deadline (the machines that run the suite are shared), and a bound on the
# examples of tests that do not set their own. GPYTORCH_DECOUPLED_HYPOTHESIS_PROFILE=dev draws new examples.
settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=50,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", deadline=None, max_examples=200)
settings.load_profile(os.environ.get("GPYTORCH_DECOUPLED_HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` run where a GPU is present and are skipped, with the reason, elsewhere."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def single_thread():
    """For modules of tiny float64 problems: more intra-op threads only add synchronization (several times the run
    time when the cores are shared, as with ``pytest -n 2``). Use with ``pytest.mark.usefixtures("single_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
