"""Reference host engine: a tiny paged-KV Llama model, trace replay, prefix cache, reference run.

Submodules are imported explicitly (``pdplug.host.model`` needs torch; ``pdplug.host.trace`` only
numpy and msgspec), so importing this package stays cheap.
"""
