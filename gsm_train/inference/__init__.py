"""Generation with GSM adapters: the packed KV store, the GSM cache, decode attention and `generate`."""

from gsm_train.inference.cache import GSMCache, GSMLayerCache, cache_kwargs

__all__ = ["GSMCache", "GSMLayerCache", "cache_kwargs"]
