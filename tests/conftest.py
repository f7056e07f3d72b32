import os
import sys
from pathlib import Path

import pytest
import torch

# The project's measurement harness (benchmarks/harness) is not installed with urpe: its tests
# import it from the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

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

# Tests that move the urpe cache (URPE_CACHE_DIR, in this process or in the commands they start)
# keep the compiled C++ kernel where `make setup` built it, instead of compiling it again (20-60
# s each). The kernel build tests set their own.
if not os.environ.get("URPE_KERNEL_CACHE_DIR"):
    from urpe.kernels.cpp.build import kernel_cache

    os.environ["URPE_KERNEL_CACHE_DIR"] = str(kernel_cache())

from .tiny import run_tiny  # noqa: E402 - imports urpe: after TRITON_INTERPRET is decided


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """Tiny tensors: more threads only add synchronisation, very slow on a loaded CPU. Use with
    `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_configure(config):
    # `make test` runs one pytest-xdist worker per core: each worker keeps to its share of the
    # cores, since threads beyond them only wait on each other. Tests about threading set their own.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, min(2, torch.get_num_threads() // workers)))


# Trained models shared by the tests of the commands and the Python API: each made once per
# session, in well under a second, and only read afterwards (tests that change a run make their
# own).


@pytest.fixture
def tiny_run(tmp_path):
    """Run a tiny `urpe reproduce EXPERIMENT` (tests/tiny.py) into a fresh folder:
    `tiny_run("synthetic", steps=2)` returns the folder."""
    count = iter(range(1_000_000))

    def run(experiment: str, *more: str, **changes) -> Path:
        return run_tiny(experiment, tmp_path / f"{experiment}-{next(count)}", *more, **changes)

    return run


@pytest.fixture(scope="session")
def lm_sweep(tmp_path_factory):
    """A sweep folder of `urpe reproduce lm` on a small byte-level text: two runs (seeds 0 and
    1). Returns (sweep folder, a short text to evaluate)."""
    from urpe.kernels.cpp import build

    # The C++ kernel is loaded once per process, from the usual cache (where `make setup` built
    # it); loaded first under the run's fresh cache folder below, it would be compiled again.
    build.load()
    root = tmp_path_factory.mktemp("lm-sweep")
    words = "the cat sat on a mat and saw two dogs run by an old red barn".split()
    picks = torch.randint(0, len(words), (1500,), generator=torch.Generator().manual_seed(0))
    text = root / "corpus.txt"
    text.write_text(
        "\n".join(
            " ".join(words[i] for i in picks[k : k + 12].tolist()) for k in range(0, len(picks), 12)
        )
        + "\n"
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("URPE_CACHE_DIR", str(root / "cache"))
        out = run_tiny("lm", root / "out", "--dataset", str(text), seeds="0,1")
    short = root / "short.txt"
    short.write_text(text.read_text()[:300])
    return out, short


@pytest.fixture(scope="session")
def molecule_model(tmp_path_factory):
    """A tiny untrained Graphormer saved with `save_model` as a model of molecules (target
    "heavy", in atoms): what `urpe predict` takes, without training one."""
    from urpe import save_model
    from urpe.data.molecules import FEATURIZATIONS
    from urpe.graph import Graphormer, GraphormerConfig

    spec = FEATURIZATIONS["zinc"]
    model = Graphormer(
        GraphormerConfig.preset("tiny"),
        node_cardinalities=spec.node_cardinalities,
        edge_cardinalities=spec.edge_cardinalities,
    )
    path = tmp_path_factory.mktemp("molecule-model") / "model"
    inputs = {"kind": "molecules", "features": "zinc", "target": "heavy", "unit": "atoms"}
    save_model(model, path, inputs=inputs)
    return path
