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
