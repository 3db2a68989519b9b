"""The engine harness every engine's application shares (vLLM's ``pdplug_vllm``, SGLang's
beside it): what starting real engine servers and comparing their answers needs, whatever the
engine.

* :mod:`pdplug_engines.procs`: an engine server as a process group, its log in a folder,
  ``GET /health`` awaited with a deadline, SIGTERM then SIGKILL of the whole group
  (``Engine``, ``launch``, ``running``);
* :mod:`pdplug_engines.metrics`: Prometheus ``/metrics`` read as sums (``scrape``,
  ``settled``);
* :mod:`pdplug_engines.tokens`: answers, the token parity of two runs, percentiles, the KV
  bytes a prompt set needs (``Completion``, ``RequestFailed``, ``compare_tokens``,
  ``percentile``, ``kv_bytes_bounds``);
* :mod:`pdplug_engines.tiny_model`: the tiny random-weight Hugging Face Llama both engines
  load (``TinyLlama``, ``build_tiny_llama``, ``token_prompts``);
* :mod:`pdplug_engines.report`: the demos' summary table of a parity run.

Free ports come from the library (:func:`pdplug.ports.free_ports`). An engine's own pieces
(its command line, its request format, its proxy or router) stay in that engine's app.
"""
