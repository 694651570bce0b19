"""Run `gsm_train.train` and SIGKILL this process at a chosen point while it saves checkpoints
(used by tests/test_checkpoint_integrity.py; not a test itself).

    python tests/fault_injection_run.py POINT N TRAIN_ARGS...

POINT `fsync`: at the N-th flush to disk of checkpoint saving (each file, the manifest, the folder,
the rename, `latest`: about 8 a checkpoint); `half_write`: once the N-th trainable.safetensors has
been written, cut it to half its size and die (a write torn by the kill); `prune`: just before the
N-th pruning (the new checkpoint and `latest` in place, older ones not yet removed).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from gsm_train import checkpoint
from gsm_train.train import main


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _before_nth(function: Callable[..., Any], n: int) -> Callable[..., Any]:
    calls = 0

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == n:
            _die()
        return function(*args, **kwargs)
    return wrapper


def _torn_nth_write(function: Callable[..., Any], n: int) -> Callable[..., Any]:
    calls = 0

    def wrapper(tensors: Any, path: str, *args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        result = function(tensors, path, *args, **kwargs)
        if calls == n:
            os.truncate(path, os.path.getsize(path) // 2)
            _die()
        return result
    return wrapper


if __name__ == "__main__":
    point, n, train_args = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    if point == "fsync":
        checkpoint.fsync_path = _before_nth(checkpoint.fsync_path, n)
    elif point == "half_write":
        checkpoint.save_file = _torn_nth_write(checkpoint.save_file, n)
    elif point == "prune":
        checkpoint._prune = _before_nth(checkpoint._prune, n)
    else:
        sys.exit(f"unknown point {point!r}")
    sys.exit(main(train_args))
