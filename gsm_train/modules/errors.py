"""The error GSM modules raise when used in a way they cannot serve."""


class GSMError(RuntimeError):
    """A GSM model was used in a way the modules cannot serve."""
