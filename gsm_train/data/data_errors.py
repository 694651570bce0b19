"""The error of a data problem (`gsm_train.data.text` re-exports it)."""

from __future__ import annotations

from gsm_train.errors import GSMError


class DataError(ValueError, GSMError):
    """A data problem stated as `SOURCE: PROBLEM. Fix: FIX.`; the parts are kept as attributes."""

    def __init__(self, source: str, problem: str, fix: str) -> None:
        super().__init__(f"{source}: {problem}. Fix: {fix}.")
        self.source, self.problem, self.fix = source, problem, fix
