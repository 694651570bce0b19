"""Run `gsm_train.train` and SIGKILL this process at a chosen point while it saves checkpoints
(used by tests/test_checkpoint_integrity.py; not a test itself).

    python tests/fault_injection_run.py POINT N TRAIN_ARGS...
    torchrun --nproc_per_node W tests/fault_injection_run.py POINT N TRAIN_ARGS...  (per rank)

POINT `fsync`: at the N-th flush to disk of checkpoint saving by gsm-train (each file it digests,
the manifest, the folder, the rename, `latest`: about 9 a checkpoint on rank 0, 2 on the others);
`half_write`: once the N-th checkpoint's shards have been written, cut this rank's to half its size
and die (a write torn by the kill); `prune`: just before the N-th pruning (the new checkpoint and
`latest` in place, older ones not yet removed).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gsm_train import durable
from gsm_train.train import main
from gsm_train.training import backend, checkpoint


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


def _torn_nth_save(function: Callable[..., Any], n: int) -> Callable[..., Any]:
    calls = 0

    def wrapper(self: Any, model: Any, optimizer: Any, folder: Path, *args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        result = function(self, model, optimizer, folder, *args, **kwargs)
        if calls == n:
            shard = next((folder / "dcp").glob(f"__{os.environ.get('RANK', '0')}_*.distcp"))
            os.truncate(shard, shard.stat().st_size // 2)
            _die()
        return result

    return wrapper


if __name__ == "__main__":
    point, n, train_args = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    if point == "fsync":  # every fsync of a save: the checkpoint's own and those of its durable writes
        checkpoint.fsync_path = durable.fsync_path = _before_nth(durable.fsync_path, n)
    elif point == "half_write":
        backend.FSDP2Backend.save_state = _torn_nth_save(backend.FSDP2Backend.save_state, n)
    elif point == "prune":
        checkpoint._prune = _before_nth(checkpoint._prune, n)
    else:
        sys.exit(f"unknown point {point!r}")
    sys.exit(main(train_args))
