"""tox's inline plugin (tox loads ``toxfile.py`` from the project root): find the CPythons that
pyenv installed, so ``tox run -m ci`` (README, command 2) finds python3.10 to 3.13 with no
``pyenv global`` first.

pyenv's shims answer only for the selected version, and tox asks each interpreter in its own
environment, so ``py310-core`` failed as a missing interpreter on a machine where pyenv holds
3.10 but selects 3.11. Each installed ``versions/X.Y.Z/bin`` is put at the end of ``PATH``
(newest patch release first): an interpreter already on ``PATH`` keeps being the one tox uses.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from tox.plugin import impl

_RELEASE = re.compile(r"^(\d+)\.(\d+)\.(\d+)$")  # CPython releases: not 3.13.0t, not envs


def pyenv_bins(root: Path) -> list[str]:
    """``bin`` folders of the CPython releases under pyenv's ``root``, newest first."""
    found = []
    for d in root.glob("versions/*/bin"):
        m = _RELEASE.match(d.parent.name)
        if m:
            found.append((tuple(int(x) for x in m.groups()), str(d)))
    return [d for _, d in sorted(found, reverse=True)]


@impl
def tox_add_core_config(core_conf: Any, state: Any) -> None:
    """Append pyenv's interpreters to ``PATH`` before tox looks for any."""
    root = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv")
    path = os.environ.get("PATH", "")
    have = set(path.split(os.pathsep))
    extra = [d for d in pyenv_bins(root) if d not in have]
    if extra:
        os.environ["PATH"] = os.pathsep.join([path, *extra] if path else extra)
