"""Exports: save/load (`load_gsm`), the folder format, LoRA, the model card, the Hub, `GSMModel`, int4."""
