"""URPE inside Hugging Face transformers models (extra `hf`: `pip install 'urpe[hf]'`).

    model = urpe.hf.add_urpe(model)                        # a gate C per self-attention, C = 1
    model.save_pretrained(out)                             # gates saved with the weights
    model = urpe.hf.from_pretrained(out, AutoModelForCausalLM)  # gates rebuilt and loaded

transformers' own `from_pretrained` loads such a folder without its gates (the folder's README.md
and config.json say so).

Importing this package registers the attention functions "urpe_eager" and "urpe_sdpa" with
transformers. Needs transformers >= 5.15 (tests pass on 5.15.1 to 5.24.0; 5.4 to 5.14 serve every
family but T5, which routed its attention through the interface only from 5.15); PEFT is optional.
"""

from ._requirements import TRANSFORMERS_VERSION  # first: a clear error without transformers
from .attention import gate_of, register
from .discovery import UnsupportedModelError, attention_modules, self_attention_modules
from .finetune import evaluate_loss, train_steps
from .options import UrpeOptions, default_max_distance
from .patch import MODULE_NAMES, add_urpe, gate_parameters
from .pretrained import from_pretrained, load_gates

register()

__all__ = [
    "MODULE_NAMES",
    "TRANSFORMERS_VERSION",
    "UnsupportedModelError",
    "UrpeOptions",
    "add_urpe",
    "attention_modules",
    "default_max_distance",
    "evaluate_loss",
    "from_pretrained",
    "gate_of",
    "gate_parameters",
    "load_gates",
    "register",
    "self_attention_modules",
    "train_steps",
]
