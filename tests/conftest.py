import pytest
import torch


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
