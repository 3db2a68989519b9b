"""Host adapters: each maps one serving engine's calls onto pdplug's Protocols."""
