"""One all-reduce for many tensors (used by the workers under tests/distributed/).

A worker that sums a model's gradients over the ranks with one ``all_reduce`` per parameter pays one collective's
scheduling per tensor: milliseconds each when 2 or 4 processes share 2 cores, most of a tiny case's time. Summing the
concatenation instead is one collective; every element is still the sum of the same values (gloo may add the ranks'
values in another order: float rounding, far below the tests' bounds).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_reduce_flat(tensors: list[torch.Tensor], group=None) -> list[torch.Tensor]:
    """The sums of ``tensors`` over ``group`` (the default group if None), as new tensors of the same shapes.

    Args:
        tensors (`list[torch.Tensor]`): tensors of one dtype (a scalar loss may ride along with the gradients).
        group (`ProcessGroup`, *optional*): the ranks to sum over.

    Returns:
        `list[torch.Tensor]`: one summed tensor per input, in order.
    """
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise ValueError(f"all_reduce_flat sums tensors of one dtype, got {sorted(map(str, dtypes))}")
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    return [part.view_as(t) for part, t in zip(flat.split([t.numel() for t in tensors]), tensors)]
