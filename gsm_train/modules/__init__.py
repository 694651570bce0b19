"""The GSM nn.Modules: the sparse gate head, the K/V compressors (ASQ, per token) with their registry,
and the cache bridge. How they attach to a model and run in its forwards is `gsm_train.attention`."""

from gsm_train.modules.cache_bridge import CacheBridge
from gsm_train.modules.errors import GSMError
from gsm_train.modules.kv_compressor import ASQCompressor
from gsm_train.modules.per_token_kv import PerTokenCompressor
from gsm_train.modules.sparse_gate import SparseGateHead

__all__ = ["ASQCompressor", "CacheBridge", "GSMError", "PerTokenCompressor", "SparseGateHead"]
