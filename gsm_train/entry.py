"""How the entry points (`gsm-train`, `python -m gsm_train.train`) end a command that stops with an
error: one line on stderr, no traceback, and an exit status that says what happened.

- 2: refused (a `GSMError`: the message names the field, file or folder, the value and the fix);
- 3: stopped by the NaN guard (`finite_guard`);
- 4: a write failed (a full disk, a quota or file-size limit, a read-only or forbidden folder): the
  files written before are intact (a run's checkpoints are written atomically), the message says
  where and, for a run, how to continue;
- 5: out of memory (the GPU's or the host's): the message says which settings to lower and, for a
  run, how to continue;
- 130: interrupted (Ctrl-C), as a shell reports SIGINT.

Any other error is a bug and keeps its traceback.

`exit_process` ends the process with a command's status; one rank of a multi-process launch leaves without
the interpreter's finalization (its docstring says why)."""

from __future__ import annotations

import atexit
import errno
import os
import sys
import threading
from collections.abc import Callable
from typing import NoReturn

import torch

from gsm_train.errors import GSMError
from gsm_train.training.finite_guard import NONFINITE_EXIT, NonFiniteError

REFUSED_EXIT = 2
WRITE_FAILED_EXIT = 4
OUT_OF_MEMORY_EXIT = 5
INTERRUPTED_EXIT = 130
# the errors of a write the machine refuses, not the code: no space, a quota, a file-size limit, a
# read-only file system, no permission
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM})
RESUME_HINT = "the checkpoints written before are intact: continue with --resume auto (same recipe and output.dir)"


def _failed_write(err: OSError) -> str:
    where = f" ({err.filename})" if err.filename else ""
    return f"a write failed: {err.strerror or err}{where}"


def run_command(command: Callable[[], int], run: bool = False) -> int:
    """`command()`'s exit status, or the status of the error it stopped with (module docstring),
    printed on one line; `run`: the command is a training run (its messages say how to continue)."""
    try:
        return command()
    except GSMError as err:
        print(f"error: {err}", file=sys.stderr)
        return REFUSED_EXIT
    except NonFiniteError as err:
        print(f"error: {err}", file=sys.stderr)
        return NONFINITE_EXIT
    except OSError as err:
        if err.errno not in WRITE_ERRNOS:
            raise
        fix = RESUME_HINT if run else "free space, or write to a folder you can write to, and run it again"
        print(f"error: {_failed_write(err)}; {fix}", file=sys.stderr)
        return WRITE_FAILED_EXIT
    except (torch.OutOfMemoryError, MemoryError) as err:
        where = "GPU" if isinstance(err, torch.OutOfMemoryError) else "host"
        lower = (
            "lower train.batch_size or data.seq_len, or set train.activation_checkpointing: true; " + RESUME_HINT
            if run
            else "lower --max-new-tokens, --batch-size or --seq-len, or run on a larger device"
        )
        detail = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
        print(f"error: out of {where} memory ({detail}); {lower}", file=sys.stderr)
        return OUT_OF_MEMORY_EXIT
    except KeyboardInterrupt:
        print(f"interrupted{'; ' + RESUME_HINT if run else ''}", file=sys.stderr)
        return INTERRUPTED_EXIT


def exit_process(status: int) -> NoReturn:
    """End this process with exit status `status`. A rank of a multi-process launch (WORLD_SIZE above 1) does
    what the interpreter's exit does first (waits for its other non-daemon threads, runs the atexit handlers,
    flushes stdout and stderr) and leaves with `os._exit`, skipping the rest of the interpreter's
    finalization: after FSDP2 has sharded a model, its process group, and with it gloo's worker threads,
    outlives `destroy_process_group`, the model's deletion and `gc.collect()` (its FSDP states stay
    referenced), and a worker that drops the last collective's work while the interpreter finalizes takes the
    GIL of a finalizing interpreter and aborts the process ("terminate called without an active exception",
    SIGABRT) after a run that succeeded (docs/reliability.md). One process exits normally."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        for thread in threading.enumerate():
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(status)
    sys.exit(status)
