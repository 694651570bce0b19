"""The GSM nn.Modules, their injection into Hugging Face causal LMs, and the per-call state of a forward."""

from gsm_train.modules.adapter import GSMAttentionAdapter
from gsm_train.modules.cache_bridge import CacheBridge
from gsm_train.modules.errors import GSMError
from gsm_train.modules.forward_state import GSMRecords, LayerRecords, gsm_collect
from gsm_train.modules.injection import (
    gsm_adapters, gsm_parameters, gsm_state_dict, inject_cache_bridge, inject_gsm, inject_kv_compressor,
    inject_sparse_gate,
)
from gsm_train.modules.kv_compressor import ASQCompressor
from gsm_train.modules.settings import (
    GSMSettings, configure_gsm, gsm_disabled, gsm_settings, gsm_settings_changed, has_gsm, set_gsm_mode,
)
from gsm_train.modules.sparse_gate import SparseGateHead

__all__ = [
    "ASQCompressor", "CacheBridge", "GSMAttentionAdapter", "GSMError", "GSMRecords", "GSMSettings", "LayerRecords",
    "SparseGateHead", "configure_gsm", "gsm_adapters", "gsm_collect", "gsm_disabled", "gsm_parameters",
    "gsm_settings", "gsm_settings_changed", "gsm_state_dict", "has_gsm", "inject_cache_bridge", "inject_gsm",
    "inject_kv_compressor", "inject_sparse_gate", "set_gsm_mode",
]
