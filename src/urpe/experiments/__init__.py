"""Experiments: paper reproductions driven by the one `urpe reproduce NAME` command.

`experiment.py` says what a reproduction is (`Experiment`: presets, options, plan, `run_one`,
report); `command.py` is the command every one shares; `runner.py` walks a sweep on
`records.py` (identity, records), `execution.py` (one run), `workers.py` (parallel runs) and
`progress.py`. `synthetic/`, `lm/` and `graph/` are the reproductions; `finetune/` (`urpe
finetune`) is an Experiment too: a user's Hugging Face model fine-tuned with and without URPE.
"""
