"""gsm-train: retrofit and train GSM sparse-attention, KV-compression and cache-bridge adapters."""

__version__ = "0.1.0"
