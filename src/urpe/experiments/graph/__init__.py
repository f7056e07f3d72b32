"""`urpe reproduce graph`: Graphormer vs Graphormer + URPE on real molecules (presets, the
experiment on the shared runner, the report and its figures)."""
