"""Benchmarks behind `urpe bench ...`: speed and memory measurements, not part of the core.

`urpe bench attention` is built from one-job modules:

    attention    the command: flags (options) in, one device's run out
    options      its flags and the defaults that depend on --device
    rows         what is timed: a row per registered backend (with and without the gate) and
                 the external baselines
    inputs       q, k, v and the Toeplitz tables every row reads
    clocks       one call in one mode, and how it is timed on each device
    measure      the pipeline: skip, build, warm up, time, divide by the baseline
    contention   threads and a busy core as conditions of a measurement block
    memory       peak resident memory per call, in subprocesses; the quadratic fit
    profiling    operators a row spends its time in
    end_to_end   one training step of small models from urpe.models
    machine      what the numbers were measured on
    targets      the targets as data, judged on records
    report       BENCHMARKS.md's CPU report; gpu_section its GPU section; plots the PNG
    cpu, cuda    the run on each device

`urpe bench model` (what URPE costs inside a model, issue 28) reuses clocks, contention,
measure, rows, end_to_end and machine, and adds:

    model            the measurement: groups measured under each condition, files out
    model_options    the command's flags (`urpe.cli` reads these)
    model_groups     its groups (what is measured, against which baseline)
    model_sizes      issue 28's sizes and a tiny set for a smoke run
    timed            calls built once, timed per case under each condition; ratios
    attention_calls  one decoding call, short rows, bfloat16 long rows
    generation       greedy generation with urpe's LanguageModel and its KV cache
    hf_llama         a Hugging Face Llama with and without add_urpe: generate (eager, static
                     cache compiled), a training step
    whole_steps      end_to_end's steps and the LM experiment's step times
    model_targets    issue 28's targets, as data; model_report its section of BENCHMARKS.md
    sections         the marked sections of BENCHMARKS.md (GPU, model)

`urpe bench compile` is `compile` (the compiling) and `compile_options` (its flags).

Every other `urpe bench` subcommand is a module of its own here, registered in `urpe.cli`. The
modules `urpe.cli` imports to build a command's flags (attention, options, rows,
model_options, compile_options) import no torch, so that `--help` answers at once
(tests/test_cli_startup.py); the rest is imported when the command runs.
"""
