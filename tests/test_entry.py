"""How the entry points end a command that runs out of memory: one line naming what to lower, exit 5,
for generation (`--max-new-tokens` beyond memory) and for a training run (how to continue); and how a
process ends (`exit_process`): one rank of several skips the interpreter's finalization, one process does not."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from run_helpers import child_env

from gsm_train.entry import OUT_OF_MEMORY_EXIT, run_command


def _runs_out(error: BaseException):
    def command() -> int:
        raise error

    return command


@pytest.mark.parametrize(
    ("error", "where"),
    [(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB"), "GPU"), (MemoryError(), "host")],
)
def test_out_of_memory_is_one_line_naming_what_to_lower(
    error: BaseException, where: str, capsys: pytest.CaptureFixture
) -> None:
    assert run_command(_runs_out(error)) == OUT_OF_MEMORY_EXIT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"out of {where} memory" in err and "--max-new-tokens" in err
    assert run_command(_runs_out(error), run=True) == OUT_OF_MEMORY_EXIT
    assert "--resume auto" in capsys.readouterr().err


# a process that ends with exit_process(7) while a thread of its own still runs, with an atexit handler, output
# still in stdout's buffer (a pipe's is block-buffered), and a global whose finalizer runs when the interpreter
# finalizes (it writes to the file descriptor itself: sys.stdout is flushed for the last time before)
ENDS_WITH_EXIT_PROCESS = """
import atexit, os, sys, threading, time
from gsm_train.entry import exit_process
class Finalized:
    def __del__(self, write=os.write):
        write(1, b" finalized")
held = Finalized()
def late():
    time.sleep(1)
    sys.stdout.write(" thread-ended")
threading.Thread(target=late).start()
atexit.register(lambda: sys.stdout.write(" atexit-ran"))
sys.stdout.write("buffered")
exit_process(7)
"""


@pytest.mark.parametrize("world_size", ["2", "1"])
def test_a_rank_of_several_ends_without_the_interpreter_s_finalization(world_size: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", ENDS_WITH_EXIT_PROCESS],
        capture_output=True,
        text=True,
        env=child_env(WORLD_SIZE=world_size),
        timeout=120,
        check=False,
    )
    assert proc.returncode == 7, proc.stderr[-2000:]
    finalized = " finalized" if world_size == "1" else ""  # a rank of two leaves before the finalization
    assert proc.stdout == "buffered thread-ended atexit-ran" + finalized
