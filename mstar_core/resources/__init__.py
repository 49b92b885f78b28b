"""Step resources: KV managers and attention managers."""
