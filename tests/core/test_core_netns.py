"""The parts of the namespace harness (pdplug.testing.netns) that need no root: argument
checks (each error names the field and the value), the exact tc and nftables text of each
fault, run ids, and the skip-or-fail rule of require_netns (run for real: without the
capabilities, dropped with setpriv when this process has them, and without nft on PATH)."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pdplug.testing.netns import Cluster, RunId, netns_available, require_netns
from pdplug.testing.netns.cleanup import check_prefix, new_run_id, process_start
from pdplug.testing.netns.faults import (
    LOSS_STEPS,
    MIN_BURST_BYTES,
    check_burst_bytes,
    check_direction,
    check_latency_ms,
    check_rate_mbit,
    default_burst_bytes,
    loss_threshold,
    switch_ruleset,
    tbf_argv,
)


@pytest.mark.parametrize("bad", [0, -1, 0.0, math.nan, math.inf, True, "200", None, 1e-7, 1e9])
def test_rate_must_be_a_finite_positive_number(bad: object) -> None:
    with pytest.raises(ValueError, match=r"rate_mbit="):
        check_rate_mbit(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -5, math.nan, 60_001, "20"])
def test_latency_must_be_positive_and_bounded(bad: object) -> None:
    with pytest.raises(ValueError, match=r"latency_ms="):
        check_latency_ms(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-0.5, 100.01, 101, math.nan, math.inf, 0.001, "1", True])
def test_loss_percent_must_be_within_0_and_100_in_steps_of_a_hundredth(bad: object) -> None:
    with pytest.raises(ValueError, match=r"percent="):
        loss_threshold(bad)  # type: ignore[arg-type]


def test_loss_thresholds() -> None:
    assert [loss_threshold(p) for p in (0, 0.01, 1, 20, 100)] == [0, 1, 100, 2000, LOSS_STEPS]


def test_burst_and_direction_checks() -> None:
    assert default_burst_bytes(200) == 25_000  # 1 ms at 200 Mbit/s
    assert default_burst_bytes(1) == MIN_BURST_BYTES
    for bad in (MIN_BURST_BYTES - 1, 2**31 + 1, 3000.0, True):
        with pytest.raises(ValueError, match="burst_bytes="):
            check_burst_bytes(bad)  # type: ignore[arg-type]
    assert check_direction("in") == "in"
    with pytest.raises(ValueError, match="direction='up': expected one of both, in, out"):
        check_direction("up")


def test_tbf_command() -> None:
    argv = tbf_argv("ns1", "eth0", rate_mbit=200, latency_ms=20, burst_bytes=25_000)
    assert " ".join(argv) == (
        "tc -n ns1 qdisc replace dev eth0 root tbf rate 200000000bit burst 25000 latency 20000us"
    )


def test_switch_rules_for_cuts_partitions_and_loss() -> None:
    script = switch_ruleset(cut=["p2"], blocked=[("p0", "p1")], loss={"p1": (500, 0)})
    assert script == textwrap.dedent(
        """\
        table bridge pdplug
        delete table bridge pdplug
        table bridge pdplug {
        \tchain links {
        \t\ttype filter hook forward priority 0; policy accept;
        \t\tiifname "p2" counter drop
        \t\toifname "p2" counter drop
        \t\tiifname "p0" oifname "p1" counter drop
        \t\toifname "p1" numgen random mod 10000 < 500 counter drop
        \t}
        }
        """
    )
    # no fault: the table goes, nothing is left in the switch
    assert switch_ruleset() == "table bridge pdplug\ndelete table bridge pdplug\n"


def test_run_ids_name_their_creator() -> None:
    rid = new_run_id("pdpx")
    assert rid.pid == os.getpid() and rid.start == process_start(os.getpid())
    assert rid.creator_alive()
    assert RunId.parse(str(rid)) == rid and RunId.parse(rid.host_ns("dec-0.b")) == rid
    assert rid.owns(rid.host_ns("a")) and not rid.owns(f"{rid}0-a")
    assert new_run_id("pdpx").seq == rid.seq + 1
    assert RunId.parse("my-netns") is None and RunId.parse("pdp-1-2") is None
    dead = RunId("pdpx", rid.pid, rid.start + 1, 0)  # same pid, another start: not the creator
    assert not dead.creator_alive()
    for bad in ("", "Pdp", "pdp-x", "9pdp", "a" * 17):
        with pytest.raises(ValueError, match="prefix="):
            check_prefix(bad)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"hosts": "ab"}, r"hosts='ab': expected a sequence"),
        ({"hosts": []}, r"at least one host"),
        ({"hosts": ["a", "b", "a"]}, r"duplicate host names \['a'\]"),
        ({"hosts": ["a/b"]}, r"host name 'a/b'"),
        ({"hosts": ["-a"]}, r"host name '-a'"),
        ({"hosts": ["x" * 33]}, r"host name 'xxx"),
        ({"hosts": ["a"], "subnet": "10.0.0.0/33"}, r"subnet='10.0.0.0/33': not an IPv4"),
        ({"hosts": ["a"], "subnet": "fd00::/64"}, r"subnet='fd00::/64'"),
        ({"hosts": ["a", "b", "c"], "subnet": "10.0.0.0/30"}, r"room for 2 hosts, 3 given"),
        ({"hosts": ["a"], "prefix": "pd-p"}, r"prefix='pd-p'"),
        ({"hosts": ["a"], "cpus": {"b": [0]}}, r"cpus names unknown hosts \['b'\]"),
        ({"hosts": ["a"], "cpus": {"a": [4096]}}, r"cpus\['a'\]=\[4096\]: cores \[4096\]"),
        ({"hosts": ["a"], "cpus": {"a": []}}, r"cpus\['a'\]=\[\]: expected a non-empty"),
    ],
)
def test_cluster_arguments_are_checked_before_anything_is_made(
    kwargs: dict[str, object], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        Cluster(**kwargs)  # type: ignore[arg-type]


def test_faults_check_their_arguments_first() -> None:
    c = Cluster(["a", "b"])  # never started: nothing exists, nothing is made
    with pytest.raises(KeyError, match="no host named 'zz' in this cluster; hosts: a, b"):
        c["zz"]
    a = c["a"]
    with pytest.raises(ValueError, match="rate_mbit=0"):
        a.limit(0)
    with pytest.raises(ValueError, match="percent=101"):
        a.loss(101)
    with pytest.raises(ValueError, match="direction='up'"):
        a.partition(direction="up")
    with pytest.raises(ValueError, match="seconds=0"):
        a.starve(seconds=0)
    with pytest.raises(ValueError, match="procs=0"):
        a.starve(procs=0)
    with pytest.raises(ValueError, match="argv='true'"):
        a.popen("true")
    assert [h.addr for h in c] == ["10.213.0.1", "10.213.0.2"] and len(c) == 2
    assert c.namespaces == [str(c.run_id), f"{c.run_id}-a", f"{c.run_id}-b"]


def test_importing_the_harness_loads_no_app_and_no_plugin() -> None:
    code = (
        "import sys, pdplug.testing, pdplug.testing.netns; "
        "print(sorted(m for m in sys.modules if m.split('.')[0].startswith('pdplug_')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]"


# --------------------------------------------------------------------------- skip or fail

RULE_TEST = """
from pdplug.testing.netns import require_netns

def test_needs_namespaces():
    require_netns()
"""


def _run_rule(tmp: Path, require: str, prefix: list[str], path: str | None = None) -> str:
    (tmp / "test_rule.py").write_text(RULE_TEST)
    env = {k: v for k, v in os.environ.items() if k != "PDPLUG_REQUIRE"}
    env.update(PDPLUG_REQUIRE=require, PYTHONDONTWRITEBYTECODE="1")
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    if path is not None:
        env["PATH"] = path
    res = subprocess.run(
        [*prefix, sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rsf", "-q", str(tmp)],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return res.stdout + res.stderr


def _unprivileged() -> list[str]:
    """A command prefix that runs without CAP_SYS_ADMIN and CAP_NET_ADMIN: ``setpriv``
    taking them out of the bounding set when this process has them, else nothing."""
    if netns_available()[0] or os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("needs setpriv (util-linux) to drop the capabilities")
        return [setpriv, "--bounding-set", "-sys_admin,-net_admin", "--"]
    return []


def test_without_the_capabilities_a_test_skips_naming_why_or_fails_when_required(
    tmp_path: Path,
) -> None:
    prefix = _unprivileged()
    skipped = _run_rule(tmp_path, "", prefix)
    assert "1 skipped" in skipped, skipped
    assert "needs network namespaces: needs CAP_SYS_ADMIN and CAP_NET_ADMIN" in skipped, skipped
    failed = _run_rule(tmp_path, "nixl,netns", prefix)
    assert "1 failed" in failed, failed
    assert "network namespaces are required (PDPLUG_REQUIRE lists netns)" in failed, failed


def test_without_nft_on_path_the_reason_names_the_package(tmp_path: Path) -> None:
    if not netns_available()[0]:
        pytest.skip(
            f"needs network namespaces to get past the capability check: {netns_available()[1]}"
        )
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("ip", "tc", "taskset", "sh"):
        found = shutil.which(tool)
        assert found is not None
        (bin_dir / tool).symlink_to(found)
    out = _run_rule(tmp_path, "", [], path=str(bin_dir))
    assert "1 skipped" in out and "not on PATH: nft (apt-get install nftables)" in out, out


def test_with_namespaces_require_netns_returns() -> None:
    if not netns_available()[0]:
        pytest.skip(f"needs network namespaces: {netns_available()[1]}")
    require_netns(env={"PDPLUG_REQUIRE": "netns"})  # neither skips nor fails
