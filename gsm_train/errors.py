"""The base class of the errors that refuse input or a use gsm-train cannot serve.

Every such error's message names the field, file or folder, the value and the fix, on its own; the
entry points (`gsm-train`, `python -m gsm_train.train`: `gsm_train.entry`) print it without a
traceback and exit with status 2. Each module keeps its own subclass (ConfigError, DataError,
ExportError, ...); this module imports nothing, so that any layer may raise one."""


class GSMError(RuntimeError):
    """Input, a folder or a use of a GSM model that gsm-train refuses; the message says why and the
    fix."""
