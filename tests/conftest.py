import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_configure(config):
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
