"""``pdplug bench …``: benchmarks, an application built on the pdplug library.

Each prints a ratio measured side by side in one run, the machine and the sizes. Sub-modules
define a click command ``cli`` and import heavy libraries only inside it; :mod:`pdplug_bench.cli`
collects them into the ``bench`` group, registered in the ``pdplug.cli`` entry-point group.
"""
