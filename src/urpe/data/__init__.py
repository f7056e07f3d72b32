"""Real data for experiments, read offline and cached (the data layer: above `urpe.models`, below
training). Subpackages may need optional extras; importing `urpe` never imports them.

- `urpe.data.molecules`: molecule graphs for graph regression (MOSES-pLogP, QM9, ZINC from local
  files), with Graphormer's shortest paths precomputed (extra `graph`).
- `urpe.data.text`: text corpora, tokenisers and contiguous batching for language modelling
  (extra `lm`).
"""
