"""Generation with GSM adapters: the packed KV store, the GSM cache, decode and prefill attention, the
captured token step, and the engine that makes `model.generate` use them."""

from gsm_train.inference.cache import GSMCache, GSMCacheLayer, cache_kwargs

__all__ = ["GSMCache", "GSMCacheLayer", "cache_kwargs"]
