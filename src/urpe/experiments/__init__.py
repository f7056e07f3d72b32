"""Experiments: paper reproductions driven by the `urpe reproduce ...` commands."""
