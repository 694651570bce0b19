"""Training windows that repeat a span of themselves (`data.copy_spans`), so that training sees far
content matches: a span seen earlier is continued by attending to what followed it there (induction,
copying), the mechanism a passkey retrieval uses, without training on any passkey template.

In each training window of T tokens, `count` times: a distance D is drawn uniformly from [L, T - L]
(L the span's `length`), then the source start s uniformly from [0, T - L - D]; the L tokens at s are
written over those at d = s + D. So d >= s + L and d + L <= T, and distances cover the whole window
evenly (a far copy is as likely as a near one). The copies are made in order; a later one may write
over an earlier one's source or destination. The tokens carry their labels (`chat_data`: a token
outside the loss is stored marked), so the copied span is what the model then reads and predicts.

Deterministic: a window's draws depend only on the data seed and the window's place in the training
stream (epoch, global batch in the epoch, row in the global batch), never on the process that takes
it: a resumed run, and a rank of a multi-process run, get the windows one process walking from the
start would get (`training_data.SpanCopiedBatches`). Only training batches pass through here;
held-out rows never do.
"""

from __future__ import annotations

import numpy as np
from torch import Tensor

_STREAM = 0xC0B1_5BA5  # keeps these draws apart from the data seed's other uses (row order, eval split)


def window_generator(seed: int, epoch: int, batch: int, row: int) -> np.random.Generator:
    """The generator of one window's copies: that of (data seed, epoch, global batch in the epoch, row
    in the global batch). Any int seed is taken (modulo 2**64)."""
    return np.random.default_rng([_STREAM, seed % 2**64, epoch, batch, row])


def copy_spans(window: Tensor, count: int, length: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    """Copy `count` spans of `length` tokens within the 1-D `window` in place (module docstring:
    distance uniform over [length, T - length], then the source start); returns the (source start,
    destination start) of each copy in the order made. ValueError when 2 * length exceeds the window
    (`data.copy_spans` is refused before that by the recipe's validation)."""
    size = window.shape[-1]
    if length < 1 or 2 * length > size:
        raise ValueError(f"spans of {length} tokens do not fit twice in a window of {size}")
    copies = []
    for _ in range(count):
        distance = int(rng.integers(length, size - length, endpoint=True))
        source = int(rng.integers(0, size - length - distance, endpoint=True))
        destination = source + distance  # its span starts after the source's ends: they never overlap
        window[destination : destination + length] = window[source : source + length]
        copies.append((source, destination))
    return copies
