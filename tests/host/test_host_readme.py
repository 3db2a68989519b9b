"""The README's set-up and trace sections say what a newcomer needs, and say it right."""

from __future__ import annotations

import json
import re
from pathlib import Path

from pdplug_host.trace import CHARS_PER_TOKEN, TRACE_BLOCK_TOKENS, parse_trace_text

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def _section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end > 0 else None]


def test_setup_is_two_commands_and_says_which_torch_the_pin_gets() -> None:
    setup = _section("Set up")
    (block,) = re.findall(r"```bash\n(.*?)```", setup, re.S)
    commands = [ln for ln in block.splitlines() if ln.strip() and not ln.startswith("#")]
    assert len(commands) == 2
    assert "pip install torch==2.13.0 &&" in commands[0] and commands[0].endswith("pdplug demo")
    text = " ".join(setup.split())
    assert "CPU wheel of torch 2.13.0 for Python 3.11 lies on local disk" in text
    assert "PyPI's default, the CUDA build" in text
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in text


def test_trace_formats_are_documented_as_the_loader_reads_them() -> None:
    traces = " ".join(_section("`pdplug demo`").split())
    assert "### Traces" in traces
    assert f"`ceil(characters / {CHARS_PER_TOKEN})` tokens" in traces
    assert f"one hash id per {TRACE_BLOCK_TOKENS}-token block" in traces
    # the documented record, with its ids spelled out, loads as documented
    (example,) = re.findall(r"`(\{\"timestamp\": 0, [^`]*\})`", traces)
    rec = json.loads(example.replace("1, ..., 13", ", ".join(map(str, range(1, 14)))))
    (req,) = parse_trace_text(json.dumps([rec]), scale=1)
    assert (req.raw_input_length, req.raw_output_length) == (6758, 500)
