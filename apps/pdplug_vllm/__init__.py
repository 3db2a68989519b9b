"""``pdplug proxy`` and the vLLM harness: an application running pdplug under real vLLM."""
