"""The one error type the text data layer raises for bad user input (names, paths, missing
packages), so a command can print its message as one line and exit 2."""

from __future__ import annotations


class DatasetError(ValueError):
    """A dataset or tokenizer cannot be loaded; the message says why and what to do, in one line.

    `setting` names the argument at fault when it is not the dataset itself ("tokenizer",
    "vocab_size"), so a command can blame the right flag.
    """

    def __init__(self, message: str, setting: str | None = None):
        super().__init__(message)
        self.setting = setting


INSTALL_LM = "pip install 'urpe[lm]'"
