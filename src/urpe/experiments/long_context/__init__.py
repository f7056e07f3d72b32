"""`urpe reproduce long-context` and `urpe evaluate long-context`: how far each encoding reaches.

`presets.py` (settings and flags, no torch), `experiment.py` (runs: a task mixture or a corpus
per variant), `evaluation.py` (measuring any causal model at many lengths), `report.py`
(results.json, results.md), `plots.py` (the figures), `evaluate.py` (the command for any trained
model or Hugging Face folder). The tasks themselves are `urpe.tasks.long_context`.
"""
