"""A recipe resolved against a model before it loads: the tuning knobs and the KV byte budget."""
