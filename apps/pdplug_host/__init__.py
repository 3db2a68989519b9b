"""Reference host engine: a tiny paged-KV Llama model, trace replay, prefix cache, reference run.

Submodules are imported explicitly (``pdplug_host.model`` needs torch; ``pdplug_host.trace`` only
numpy and msgspec), so importing this package stays cheap.
"""
