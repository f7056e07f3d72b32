import os

import pytest
import torch

# Triton decides when it is imported whether to run its CPU interpreter. Without a GPU the Triton
# kernel's tests run under the interpreter, so turn it on before anything imports triton.
# URPE_TEST_DEVICE=cuda (`make test-gpu`) runs them natively and fails where there is no GPU.
if os.environ.get("URPE_TEST_DEVICE") == "cuda":
    if not torch.cuda.is_available():
        raise RuntimeError("URPE_TEST_DEVICE=cuda, but torch sees no CUDA device")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError(
            "URPE_TEST_DEVICE=cuda runs the kernels natively: unset TRITON_INTERPRET"
        )
elif not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_configure(config):
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
