"""The error GSM modules raise when used in a way they cannot serve: the refusal every gsm-train
error derives from (`gsm_train.errors`)."""

from gsm_train.errors import GSMError

__all__ = ["GSMError"]
