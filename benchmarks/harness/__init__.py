"""The project's measurement harness (not installed with urpe): run by the scripts beside it
(benchmarks/*.py, `make bench`, `make bench-model`), imported by tests/ through tests/conftest.py.

    attention_report  BENCHMARKS.md's attention report on a run of `urpe bench attention`:
                      contention (threads, a busy core), end_to_end (training steps), targets,
                      report (the CPU Markdown), gpu_section (the GPU section), plots, sections
                      (the marked parts of BENCHMARKS.md)
    model             the model benchmark: model_groups (what is measured), model_sizes, timed
                      (calls built once, timed per condition), attention_calls, generation,
                      hf_llama, whole_steps, model_targets and model_report
    graph_packing     Graphormer training steps, packed molecule batches against padded ones
    compile_matrix    the Triton kernels compiled ahead of time for sm_80 / sm_90 from what the
                      public call launches (launches, covering): registers, spills, shared memory
"""
