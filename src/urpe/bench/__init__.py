"""Benchmarks behind `urpe bench attention`: speed and memory at a user's shapes, not part of
the core.

    attention     the command: flags (options) in, one device's run out
    options       its flags and the defaults that depend on --device
    rows          what is timed: a row per registered backend (with and without the gate) and
                  the external baselines; row_kinds what a row is; packing_rows packed
                  sequences and the decay bias
    inputs        q, k, v and the Toeplitz tables every row reads
    clocks        one call in one mode, and how it is timed on each device
    measure       the pipeline: skip, build, warm up, time, divide by the baseline
    memory        peak resident memory per call, in subprocesses
    profiling     operators a row spends its time in
    machine       what the numbers were measured on
    cpu, cuda     the run on each device

The repository's benchmarks/ (not installed) builds the project's own reports on these: the
targets and BENCHMARKS.md, runs under contention, the model benchmark (`make bench-model`) and
the Triton kernels' ahead-of-time compile matrix. The modules `urpe.cli` imports to build the
command's flags (attention, options, rows, row_kinds) import no torch, so that `--help` answers
at once (tests/test_cli_startup.py).
"""
