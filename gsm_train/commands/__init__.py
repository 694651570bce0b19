"""The CLI's commands beside training: evaluate, generate, passkey, inspect."""
