"""The SGLang engine harness: real SGLang 0.5.23 servers on this CPU-only machine.

* :mod:`pdplug_sglang.engines`: ``python -m sglang.launch_server`` (single, prefill, decode;
  any transfer backend, PP prefill) and SGLang's router (``--pd-disaggregation --mini-lb``);
* :mod:`pdplug_sglang.overlay`: the folder put first on the engines' ``PYTHONPATH``: the CPU
  stand-in for ``sgl_kernel`` (:mod:`pdplug_sglang.cpu_kernel`) and the harness's own SGLang
  plugin (:mod:`pdplug_sglang.cpu_patches`: CPU workarounds for SGLang's own backends);
* :mod:`pdplug_sglang.client`: ``/generate`` with ``input_ids`` prompts, streaming, TTFT;
* :mod:`pdplug_sglang.parity`: a disaggregated run token-compared with a single engine.

What is not about SGLang (process groups, token parity, the tiny model, the summary table)
comes from :mod:`pdplug_engines`.
"""
