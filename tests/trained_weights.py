"""Comparing the weights of two runs that must train alike (several ranks or nodes against one process)."""

from __future__ import annotations

import torch


def largest_difference(one: dict[str, torch.Tensor], two: dict[str, torch.Tensor]) -> float:
    """The largest difference of any weight, the keys' biases of attention left out: a softmax does not change when a
    constant is added to its scores, so their gradient is zero but for rounding, and AdamW turns that rounding into
    steps of its own (3e-6 over 6 steps where a run trains without Hopfield retrieval, as its warm-up does:
    objective.start_without_hopfield), whatever the order of a sum."""

    def compared(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if not name.endswith("in_proj_bias"):
            return tensor
        width = tensor.shape[0] // 3  # queries, keys, values
        return torch.cat([tensor[:width], tensor[2 * width:]])

    assert one.keys() == two.keys()
    return max((compared(k, one[k]) - compared(k, two[k])).abs().max().item() for k in one)
