"""Documents inside a token stream, for packed training.

A corpus is one stream of tokens; its documents (speeches, paragraphs, articles) end where a
separator occurs, by default a blank line. Packing keeps the stream's contiguous rows (no
padding) and marks, per row, which document every input belongs to:

    inputs     T h e  \\n \\n A  n  d  \\n \\n W  e      (separator "\\n\\n")
    documents  0 0 0  0  0  1  1  1  1  1  2  2
    targets    h e \\n \\n -  n  d \\n \\n -  e  ...     (-: not scored)

A document ends with its separator; the target after it (the next document's first token) is not
scored, as its document alone has no such target. A document cut by the end of a row goes on in
the next row as a document of its own. With these ids a model attends only within a document,
at positions counted from the document's start (`urpe.TransformerDecoder(document_ids=)`), so
every scored target gets the loss that its document alone, run from the start of the row's part,
would give it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .batching import IGNORE_INDEX


def document_ends(tokens: Tensor, separator: Tensor) -> Tensor:
    """(N,) bool, True at the last token of every occurrence of `separator` (k,) in `tokens`
    (N,); occurrences may overlap ("\\n\\n\\n" ends two)."""
    if separator.dim() != 1 or separator.numel() == 0:
        raise ValueError("a document separator must be a non-empty 1-D sequence of token ids")
    k = separator.numel()
    ends = torch.zeros(tokens.shape[0], dtype=torch.bool)
    if tokens.shape[0] < k:
        return ends
    windows = tokens.long().unfold(0, k, 1)  # (N - k + 1, k)
    ends[k - 1 :] = (windows == separator.long()).all(-1)
    return ends


def packed_documents(ends: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """Per row, document ids and the targets that stay scored.

    ends: (B, L) bool, True where an input ends its document (from `document_ends`, gathered at
    the rows' stream positions); targets: (B, L). Returns document ids (B, L) int64, counting
    from 0 in every row, and the targets with those after a document's last input unscored.
    """
    starts = torch.zeros_like(ends)
    starts[:, 1:] = ends[:, :-1]
    return starts.long().cumsum(-1), targets.masked_fill(ends, IGNORE_INDEX)
