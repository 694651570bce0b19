"""How the entry points end a command that runs out of memory: one line naming what to lower, exit 5,
for generation (`--max-new-tokens` beyond memory) and for a training run (how to continue)."""

from __future__ import annotations

import pytest
import torch

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
