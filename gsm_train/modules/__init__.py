"""The GSM nn.Modules and their injection into Hugging Face causal LMs."""

from gsm_train.modules.cache_bridge import CacheBridge
from gsm_train.modules.decode_cache import GSMCache, cache_kwargs
from gsm_train.modules.gsm_attention import GSMError, GSMRuntime
from gsm_train.modules.injection import (
    gsm_disabled, gsm_parameters, gsm_runtime, gsm_state_dict, inject_cache_bridge, inject_gsm,
    inject_kv_compressor, inject_sparse_gate, set_gsm_mode,
)
from gsm_train.modules.kv_compressor import ASQCompressor
from gsm_train.modules.sparse_gate import SparseGateHead

__all__ = [
    "ASQCompressor", "CacheBridge", "GSMCache", "GSMError", "GSMRuntime", "SparseGateHead", "cache_kwargs",
    "gsm_disabled", "gsm_parameters", "gsm_runtime", "gsm_state_dict", "inject_cache_bridge", "inject_gsm",
    "inject_kv_compressor", "inject_sparse_gate", "set_gsm_mode",
]
