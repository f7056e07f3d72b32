"""How the three Triton kernels are launched: tile configurations, autotuning, grids, failures.

A `Launch` is one kernel call with its arguments already laid out (built in `ops.py` from the
raw ops' `ForwardArgs` / `BackwardArgs`); `run_launch` sends it to the GPU (or the interpreter)
and `compile_kernels.py` compiles the very same argument list ahead of time for sm_80 / sm_90.

Grid. One program per (tile of the walked length, batch * head), folded onto grid axis 0 with
the tile index fastest: programs of one head run side by side and share its keys and values in
L2, and axis 0 takes 2^31 - 1 programs, where axes 1 and 2 stop at 65,535 (b * h = 512 * 128
would not fit there).

Tile configurations. (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel, per padded head
dim and per dtype family, each one compiled for sm_80 and sm_90 by `compile_kernels.py` (with
every pair of the call features that change the program) and kept only if it spills nothing
(fp16 / bf16) and fits the shared memory of both. Every configuration states the register cap
(`MAX_REGISTERS`). The autotuner gets the union and prunes to the entry of the call's
(BLOCK_D, dtype) before timing.
"""

from __future__ import annotations

import inspect
from typing import NamedTuple

import torch
import triton

from ..backends import BackendFailure
from . import kernels as K

# Under the interpreter: small tiles, so that tests at small lengths cross several of them.
INTERPRETER_BLOCK = 16
# Registers a thread may use (ptx .maxnreg), stated for every configuration: the hardware's
# maximum. Left unstated, ptxas picks its own budget by an occupancy estimate and spills
# below it: the 32 x 32 dK/dV kernel came out at 128 registers and 8 B of spills for a
# relation-bias call, 198 registers and none with the cap stated (`compile_kernels.py`).
MAX_REGISTERS = 255

# (kernel, BLOCK_D bucket, dtype family) -> (BLOCK_M, BLOCK_N, num_warps, num_stages), best
# first. "half": fp16 / bf16; "fp32" and "fp64" multiply exactly ("ieee"). BLOCK_D > 128 uses
# the 128 entry.
CONFIGS: dict[tuple[str, int, str], tuple[tuple[int, int, int, int], ...]] = {
    # The forward kernel: 64 x 32 at 8 warps at every head dim. Recorded from the public call
    # (sm_80 / sm_90, fp16 / bf16), 128 x 32 at 8 warps spilled 8 to 32 B (dense bias and gate
    # with a bool mask) and 64 x 32 at 4 warps 8 to 288 B (a Toeplitz gate with exp, every
    # mask, documents and dropout, G=4, D=40); earlier 64 x 64 spilled at D <= 128.
    ("forward", 64, "half"): ((64, 32, 8, 3),),
    ("forward", 128, "half"): ((64, 32, 8, 3),),
    # The dK/dV kernel: 32 x 32 at 4 warps (D <= 64) and 16 x 64 at 8 warps (D <= 128) reached
    # the 255-register cap and spilled 8 to 208 B (sm_80 and sm_90, fp16 / bf16, recorded from
    # the public call): grouped queries with a dense bias, a Relation gate and l2 plus padding,
    # a mask and dropout; a Toeplitz gate with exp, every mask, documents and dropout; at
    # D = 40 and 104. 16 x 32 tiles, as the Decay variant had already.
    ("backward_kv", 64, "half"): ((16, 32, 4, 2),),
    ("backward_kv", 128, "half"): ((16, 32, 8, 2),),
    # The dQ kernel: 32 x 32 at 4 warps spilled 32 B (sm_90, the Toeplitz-gate call above);
    # 32 x 64 at 8 warps reached the 255 cap, 32 x 32 at 8 warps needs at most 233.
    ("backward_q", 64, "half"): ((32, 32, 8, 2),),
    ("backward_q", 128, "half"): ((32, 32, 8, 2), (16, 64, 8, 2)),
    # exact ("ieee") float32 / float64 products hold more per thread: small tiles, many warps
    ("forward", 64, "fp32"): ((32, 32, 4, 2),),
    ("forward", 128, "fp32"): ((32, 32, 8, 2),),
    ("backward_kv", 64, "fp32"): ((16, 32, 4, 2),),
    ("backward_kv", 128, "fp32"): ((16, 32, 8, 2),),
    ("backward_q", 64, "fp32"): ((16, 32, 4, 2),),
    ("backward_q", 128, "fp32"): ((16, 32, 8, 2),),
    # Variants with their own configurations (`configs_for`; other dtypes use the kernel's).
    # Documents: in the dQ kernel 32 x 32 spilled 8 B for a Toeplitz bias's gradient + dropout
    # + every mask, Lq=1, Lk=1024 (sm_90, bf16, D=128)
    ("backward_q_docs", 128, "half"): ((16, 64, 8, 2),),
}
for (_kernel, _d, _family), _shapes in list(CONFIGS.items()):
    if _family == "fp32":
        CONFIGS[(_kernel, _d, "fp64")] = _shapes

KERNELS = {
    "forward": K.attention_fwd_kernel,
    "backward_kv": K.attention_bwd_kv_kernel,
    "backward_q": K.attention_bwd_q_kernel,
}
# The length each kernel's programs tile (the grid's first factor) and the block that tiles it.
TILED_BY = {"forward": "BLOCK_M", "backward_kv": "BLOCK_N", "backward_q": "BLOCK_M"}

TUNING_KEY = [
    "lq_bucket",
    "lk_bucket",
    "BLOCK_D",
    "BLOCK_DV",
    "B_KIND",
    "C_KIND",
    "NORM",
    "CAUSAL",
    "HAS_PAD",
    "HAS_MASK",
    "DOCS",
    "DROPOUT",
]


def dtype_family(dtype) -> str:
    """ "half", "fp32" or "fp64" for a torch or Triton dtype."""
    name = str(dtype).replace("torch.", "")
    if name in ("fp64", "float64"):
        return "fp64"
    if name in ("fp32", "float32"):
        return "fp32"
    return "half"


def configs_for(
    kernel: str, block_d: int, family: str, decay_grad: bool = False, documents: bool = False
) -> tuple[tuple[int, int, int, int], ...]:
    """The tile configurations the autotuner may pick for this kernel, head dim and dtype, and
    the variant: a Decay's gradient wanted (B_GRAD = DECAY), document ids (DOCS)."""
    d = 64 if block_d <= 64 else 128
    for variant, on in (("decay", decay_grad), ("docs", documents)):
        if on and (f"{kernel}_{variant}", d, family) in CONFIGS:
            return CONFIGS[(f"{kernel}_{variant}", d, family)]
    return CONFIGS[(kernel, d, family)]


class Launch(NamedTuple):
    """One kernel call: its positional arguments (the kernel's order), constexpr flags other
    than the tiles, the length its programs tile and the programs per tile (batch * heads)."""

    kernel: str  # a key of KERNELS
    args: tuple
    meta: dict
    length: int
    rows: int


class KernelFailure(BackendFailure):
    """The Triton kernel could not be compiled or launched on this device."""


def width(block_m: int, block_n: int) -> int:
    """The Toeplitz gradient's diagonal count of a tile, padded to a power of two."""
    return triton.next_power_of_2(block_m + block_n - 1)


def tile_meta(kernel: str, block_m: int, block_n: int) -> dict:
    meta = dict(BLOCK_M=block_m, BLOCK_N=block_n)
    if kernel == "backward_q":
        meta["WIDTH"] = width(block_m, block_n)
    return meta


def grid_size(launch: Launch, meta: dict) -> tuple[int]:
    """(tiles * rows,): see the module docstring for why one axis."""
    return (triton.cdiv(launch.length, meta[TILED_BY[launch.kernel]]) * launch.rows,)


def _autotune(configs, **options):
    """`triton.autotune`, persisting results on disk where this Triton can (>= 3.3)."""
    if "cache_results" in inspect.signature(triton.autotune).parameters:
        options["cache_results"] = True
    return triton.autotune(configs, **options)


def _prune(kernel: str):
    """Keep the configurations of the call's (BLOCK_D, dtype family)."""

    def prune(configs, named_args, **kwargs):
        block_d = max(kwargs["BLOCK_D"], kwargs["BLOCK_DV"])
        family = dtype_family(named_args["q_ptr"].dtype)
        variant = dict(
            decay_grad=kwargs.get("B_GRAD") == K.DECAY.value, documents=bool(kwargs.get("DOCS"))
        )
        wanted = {
            tuple(tile_meta(kernel, m, n).items()) + (w, s)
            for m, n, w, s in configs_for(kernel, block_d, family, **variant)
        }
        kept = [
            c for c in configs if tuple(c.kwargs.items()) + (c.num_warps, c.num_stages) in wanted
        ]
        return kept or configs[:1]

    return prune


_autotuned: dict[str, object] = {}


def tuned(kernel: str):
    """The autotuned launcher of a kernel (built on first use: never under the interpreter)."""
    if kernel not in _autotuned:
        # the kernel's configurations and its variants' ("backward_kv_decay", ...)
        mine = [
            v
            for (name, _, _), v in CONFIGS.items()
            if name == kernel or name.startswith(f"{kernel}_")
        ]
        shapes = sorted({s for v in mine for s in v})
        configs = [
            triton.Config(tile_meta(kernel, m, n), num_warps=w, num_stages=s, maxnreg=MAX_REGISTERS)
            for m, n, w, s in shapes
        ]
        options = dict(key=TUNING_KEY, prune_configs_by={"early_config_prune": _prune(kernel)})
        if kernel == "backward_q":
            options["key"] = [*TUNING_KEY, "B_GRAD", "C_GRAD"]
            options["reset_to_zero"] = ["dB_ptr", "dC_ptr"]  # atomically accumulated
        elif kernel == "backward_kv":
            options["key"] = [*TUNING_KEY, "B_GRAD"]  # a Decay's gradient, or none
        _autotuned[kernel] = _autotune(configs, **options)(KERNELS[kernel])
    return _autotuned[kernel]


def interpreting() -> bool:
    """Whether Triton runs its CPU interpreter (TRITON_INTERPRET=1 at import)."""
    knobs = getattr(triton, "knobs", None)  # Triton >= 3.4; older ones read the environment
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    import os

    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def fixed_blocks(block_q: int, block_k: int) -> tuple[int, int] | None:
    """The one configuration (BLOCK_M queries x BLOCK_N keys) to run, or None to autotune."""
    if block_q > 0 and block_k > 0:
        return block_q, block_k
    if interpreting():
        return INTERPRETER_BLOCK, INTERPRETER_BLOCK
    return None


def run_launch(launch: Launch, blocks: tuple[int, int] | None) -> None:
    """Launch (autotuned when blocks is None). A compile or launch error of Triton's own becomes
    `KernelFailure`, so that `urpe.attention(backend="auto")` can move to the next backend."""
    try:
        if blocks is None:
            grid = lambda cfg: grid_size(launch, cfg)  # noqa: E731
            tuned(launch.kernel)[grid](*launch.args, **launch.meta)
        else:
            meta = tile_meta(launch.kernel, *blocks)
            if not interpreting():
                meta["maxnreg"] = MAX_REGISTERS
            KERNELS[launch.kernel][grid_size(launch, meta)](*launch.args, **launch.meta, **meta)
    except (torch.OutOfMemoryError, KeyboardInterrupt):
        raise
    except Exception as error:  # noqa: BLE001 - anything Triton raises while building/launching
        raise KernelFailure(
            f"the Triton kernel could not be compiled or launched here: "
            f"{type(error).__name__}: {_first_line(error)}"
        ) from error


def _first_line(error: Exception) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no message"
