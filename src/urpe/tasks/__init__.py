"""Data for experiments: task generators on plain torch (no training framework here)."""

from .synthetic import (
    TASKS,
    SyntheticTask,
    even_token_prediction,
    get_task,
    position_identification,
    position_probe,
)

__all__ = [
    "TASKS",
    "SyntheticTask",
    "even_token_prediction",
    "get_task",
    "position_identification",
    "position_probe",
]
