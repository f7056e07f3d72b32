"""T5's sign-aware logarithmic buckets over relative offsets."""

from __future__ import annotations

import math

import torch
from torch import Tensor

# The options of every bucketed encoding and gate ("t5"), with T5's defaults.
BUCKET_OPTIONS = {"num_buckets": 32, "bucket_max_distance": 128}


def t5_buckets(
    offsets: Tensor, num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = True
) -> Tensor:
    """Map offsets d = j - i to bucket ids in [0, num_buckets).

    Small distances get a bucket each; larger ones share log-spaced buckets up to max_distance,
    beyond which everything falls in the last bucket. Bidirectional mode spends half the buckets
    on keys after the query (d > 0). Unidirectional mode puts all d > 0 in bucket 0.
    """
    distance = -offsets  # i - j: positive for keys before the query
    bucket = torch.zeros_like(offsets)
    if bidirectional:
        num_buckets //= 2
        bucket = bucket + (distance < 0).long() * num_buckets
        distance = distance.abs()
    else:
        distance = distance.clamp_min(0)
    exact = num_buckets // 2
    # log-spaced buckets from `exact` to max_distance; the float maths only sees distance >= exact
    far = (
        exact
        + (
            torch.log(distance.clamp_min(exact).float() / exact)
            / math.log(max_distance / exact)
            * (num_buckets - exact)
        ).long()
    )
    far = far.clamp_max(num_buckets - 1)
    return bucket + torch.where(distance < exact, distance, far)
