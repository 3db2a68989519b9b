"""The runnable examples run, and the README's snippets are faithful excerpts of them (issue 15
item 7): every code line the README shows is a line of an example that a test runs."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pdplug.testing import require

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
README = (ROOT / "README.md").read_text()


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDPLUG_")}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def _python_blocks(section: str) -> list[str]:
    body = README.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", body, flags=re.S)


def _imports(src: str) -> list[tuple[str, str]]:
    return [
        (node.module or "", a.name)
        for node in ast.walk(ast.parse(src))
        if isinstance(node, ast.ImportFrom)
        for a in node.names
    ]


def _code_lines(src: str) -> list[str]:
    return [ln.strip() for ln in src.splitlines() if ln.strip() and not ln.strip().startswith("#")]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("consensus", ["pp0", "ring"])
def test_consensus_example_agrees_across_two_pp_processes(consensus: str) -> None:
    out = _run(str(EXAMPLES / "consensus_pp.py"), consensus, timeout=200)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "identical decisions on every rank: good [1, 2], bad [3]" in out.stdout
    # a bad vote decides at once, good waits for every rank: rounds may split differently
    # from run to run, but never between ranks
    applied = re.findall(r"^PP rank (\d) applied: (.*)$", out.stdout, flags=re.M)
    assert [r for r, _ in applied] == ["0", "1"], out.stdout
    assert applied[0][1] == applied[1][1], out.stdout
    decisions = ast.literal_eval(applied[0][1])
    assert [d[1] for d in decisions] == list(range(len(decisions))), "numbered gap-free"
    assert sorted(r for d in decisions for r in d[2]) == [1, 2], out.stdout
    assert sorted(r for d in decisions for r in d[3]) == [3], out.stdout


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_transfer_example_moves_every_byte_to_dcp_2(backend: str) -> None:
    require(backend)
    out = _run(str(EXAMPLES / "transfer_dcp.py"), backend, timeout=280)
    assert out.returncode == 0, out.stdout + out.stderr
    for rank in (0, 1):
        assert f"decode DCP rank {rank}: Success 50 tokens, 0 wrong rows" in out.stdout
    assert "prefill: Success" in out.stdout


def test_readme_embedding_snippet_is_an_excerpt_of_the_examples() -> None:
    (snippet,) = _python_blocks("Embedding pdplug in a host engine")
    compile(snippet, "README.md", "exec")
    sources = [(EXAMPLES / n).read_text() for n in ("consensus_pp.py", "transfer_dcp.py")]
    example = {ln for src in sources for ln in _code_lines(src)}
    imported = {(m, n) for src in sources for m, n in _imports(src)}
    code = [ln for ln in _code_lines(snippet) if not ln.startswith(("from ", "import "))]
    missing = [ln for ln in code if ln not in example]
    assert missing == [], "README lines not in examples/consensus_pp.py or transfer_dcp.py"
    assert set(_imports(snippet)) <= imported, "the README imports what the examples import"
    assert len(code) >= 30


def test_readme_override_snippet_is_the_example_plugin_and_testing_is_documented(
    tmp_path: Path,
) -> None:
    blocks = _python_blocks("Overriding a default (plugin authors)")
    plugin = EXAMPLES / "override-consensus" / "pdplug_logging_consensus" / "__init__.py"
    lines = set(_code_lines(plugin.read_text()))
    assert [ln for ln in _code_lines(blocks[0]) if ln not in lines] == []
    assert 'pytest_plugins = ["pdplug.testing"]' in blocks[1]
    assert 'pip install "pdplug[testing]"' in README
    # the documented conftest line works in a plugin author's own suite
    (tmp_path / "conftest.py").write_text(blocks[1])
    (tmp_path / "test_mine.py").write_text(
        "def test_defaults(plugin_manager):\n"
        "    assert plugin_manager.names('consensus') == ['pp0', 'ring']\n"
        "    assert plugin_manager.strict\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 passed" in out.stdout
