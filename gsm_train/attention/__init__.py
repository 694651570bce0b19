"""GSM attention on a Hugging Face causal LM: injecting the modules, the frozen settings a model carries,
the per-call state of a forward and what it records (`gsm_collect`), and the attention function
(`dispatch`) with its parts: the adapter's K/V path, the layout of a forward, the top-k selection and
the training-time records."""

from gsm_train.attention.adapter import GSMAttentionAdapter
from gsm_train.attention.forward_state import GSMRecords, LayerRecords, gsm_collect
from gsm_train.attention.injection import (
    gsm_adapters,
    gsm_parameters,
    gsm_state_dict,
    inject_cache_bridge,
    inject_gsm,
    inject_kv_compressor,
    inject_sparse_gate,
)
from gsm_train.attention.settings import (
    GSMSettings,
    configure_gsm,
    gsm_disabled,
    gsm_settings,
    gsm_settings_changed,
    has_gsm,
    set_gsm_mode,
)

__all__ = [
    "GSMAttentionAdapter",
    "GSMRecords",
    "GSMSettings",
    "LayerRecords",
    "configure_gsm",
    "gsm_adapters",
    "gsm_collect",
    "gsm_disabled",
    "gsm_parameters",
    "gsm_settings",
    "gsm_settings_changed",
    "gsm_state_dict",
    "has_gsm",
    "inject_cache_bridge",
    "inject_gsm",
    "inject_kv_compressor",
    "inject_sparse_gate",
    "set_gsm_mode",
]
