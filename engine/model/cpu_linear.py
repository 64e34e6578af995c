"""Linear layers with oneDNN-prepacked weights for small batches on CPU.

Measured on this project's 2-core CPUs (fp32, SmolLM2 shapes): oneDNN with prepacked weights
runs a matrix-vector product ~1.4x and a 32-row product ~1.3-2x faster than F.linear (MKL).
From a few hundred rows on, which is faster depends on the CPU: on the one these layers were
first measured on F.linear stayed ahead, on an AMD EPYC of family 26 (Zen 5) oneDNN runs a
1,024-row product 2.4x faster (323 vs 137 GFLOP/s, 2 threads). So both layouts are kept:
decode steps take the packed one, and whether prefill chunks above PACKED_MAX_ROWS rows take
it too is measured once per process (packed_max_rows); weights cost twice the memory.
"""

from __future__ import annotations

import functools
import logging
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

PACKED_MAX_ROWS = 256  # at or below this many rows the packed weight is faster on every CPU
PROBE_ROWS, PROBE_SHAPE = 1024, (1536, 576)  # a prefill chunk through one of SmolLM2's MLP products


def onednn_available(weight: torch.Tensor) -> bool:
    """True if oneDNN can pack and multiply this CPU weight (probed once per call)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight[:8].contiguous())
        torch.ops.mkldnn._linear_pointwise(
            torch.zeros(1, weight.shape[1], dtype=weight.dtype), packed, None, "none", [], ""
        )
        return True
    except (RuntimeError, AttributeError) as exc:
        logger.info("oneDNN packed linear unavailable (%s); using F.linear", exc)
        return False


@functools.cache
def packed_max_rows() -> int:
    """The most rows a PackedLinear multiplies with the packed weight: unbounded where oneDNN
    beats F.linear by 10% on a PROBE_ROWS-row product (best of 3 each, at the current torch
    threads, ~0.1 s once per process), else PACKED_MAX_ROWS."""
    gen = torch.Generator().manual_seed(0)  # the global RNG stays as the caller left it
    weight = torch.randn(PROBE_SHAPE, generator=gen)
    x = torch.randn(PROBE_ROWS, PROBE_SHAPE[1], generator=gen)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight)

    def best(product) -> float:
        product()  # warm-up
        times = []
        for _ in range(3):
            start = time.perf_counter()
            product()
            times.append(time.perf_counter() - start)
        return min(times)

    plain_s = best(lambda: F.linear(x, weight))
    packed_s = best(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
    rows = sys.maxsize if packed_s < 0.9 * plain_s else PACKED_MAX_ROWS
    logger.info(
        "%d-row product: oneDNN packed %.1f ms, F.linear %.1f ms: packed up to %s rows",
        PROBE_ROWS,
        1e3 * packed_s,
        1e3 * plain_s,
        "any number of" if rows == sys.maxsize else rows,
    )
    return rows


class PackedLinear(nn.Module):
    """y = x W^T + b, choosing the packed (oneDNN) or plain (MKL) weight by row count."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = weight  # [N, K]
        self.bias = bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        self.max_rows = packed_max_rows()

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> PackedLinear:
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= self.max_rows:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def pack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear in model (recursively) by a PackedLinear; returns the count."""
    count = 0
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, PackedLinear.from_linear(child))
            count += 1
        else:
            count += pack_linears(child)
    return count
