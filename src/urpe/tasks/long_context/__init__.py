"""Long-context tasks generated from a seed, written in any tokenizer's tokens (no download).

pieces = Pieces(tokenizer_encode)                 # text -> ids, e.g. a urpe or HF tokenizer
sample = TASKS["passkey"].sample(pieces, 512, torch.Generator().manual_seed(0), depth=0.5)
sample.tokens            # (512,) ids
sample.hits(predictions) # per answer unit: right in every token?
"""

from .generators import (
    TASKS,
    AssociativeRecall,
    Copy,
    LongContextTask,
    MultiKeyNeedle,
    Needle,
    Passkey,
    VariableTracking,
    long_context_task,
)
from .layout import IGNORE_INDEX, Sample, TooShort
from .words import DIGITS, FILLER, KEYS, TASK_WORDS, VALUES, Pieces

__all__ = [
    "DIGITS",
    "FILLER",
    "IGNORE_INDEX",
    "KEYS",
    "TASKS",
    "TASK_WORDS",
    "VALUES",
    "AssociativeRecall",
    "Copy",
    "LongContextTask",
    "MultiKeyNeedle",
    "Needle",
    "Passkey",
    "Pieces",
    "Sample",
    "TooShort",
    "VariableTracking",
    "long_context_task",
]
