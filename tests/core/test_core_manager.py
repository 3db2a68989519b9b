"""PluginManager: discovery through real entry points, override/block/duplicate/unknown names,
switches and their precedence, failure isolation (issue 2)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from _core_fakes import FakeConsensus, consensus_hook, install_module, kv_hook

from pdplug import (
    ConsensusConfig,
    ConsensusSpec,
    KVSenderSpec,
    PluginError,
    PluginManager,
    hookimpl,
)
from pdplug.errors import DuplicateComponentError, UnknownComponentError
from pdplug.manager import EXTENSION_POINTS, discover_entry_points, normalize
from pdplug.testing import fake_entry_point, fake_layout, fake_peer, make_plugin_manager
from pdplug.types import PdplugEvent

DEFAULT_PLUGINS = {
    "pdplug-consensus": "pdplug_consensus",
    "pdplug-dcp": "pdplug_dcp",
    "pdplug-nixl": "pdplug_nixl",
    "pdplug-mooncake": "pdplug_mooncake",
    "pdplug-scheduler": "pdplug_scheduler",
}
CFG = ConsensusConfig(pp_rank=0, pp_size=1, endpoints=("tcp://127.0.0.1:1",))


def _make(tag: str) -> Any:
    return lambda config: FakeConsensus(config, tag)


def third_party(
    monkeypatch: pytest.MonkeyPatch,
    dist: str,
    *specs: ConsensusSpec,
    module: str | None = None,
) -> Any:
    """A fake third-party distribution ``dist`` whose plugin module yields ``specs``."""
    mod = module or normalize(dist).replace("-", "_")
    install_module(monkeypatch, mod, pdplug_register_consensus=consensus_hook(*specs))
    return fake_entry_point(dist, mod, dist=dist, version="1.2.3")


def with_defaults(*eps: Any) -> list[Any]:
    return [*discover_entry_points(), *eps]


# --------------------------------------------------------------------------- real entry points


def test_defaults_come_from_the_installed_distribution_entry_points() -> None:
    eps = {ep.name: ep for ep in discover_entry_points()}
    assert set(DEFAULT_PLUGINS) <= set(eps), "pdplug is not installed (pip install -e .)"
    for name, module in DEFAULT_PLUGINS.items():
        assert eps[name].value == module
        assert eps[name].dist is not None and eps[name].dist.name == "pdplug"

    pm = PluginManager(env={})
    recs = {r.name: r for r in pm.records}
    for name in DEFAULT_PLUGINS:
        assert recs[name].distribution == "pdplug"
        assert recs[name].status == "loaded"
        assert recs[name].default
    assert recs["pdplug-consensus"].provides == {"consensus": ["pp0", "ring"]}
    assert recs["pdplug-dcp"].provides == {"pack_planner": ["dcp", "tp"]}
    assert recs["pdplug-nixl"].provides == {"kv_sender": ["nixl"]}
    assert recs["pdplug-mooncake"].provides == {"kv_sender": ["mooncake"]}
    assert recs["pdplug-scheduler"].provides == {"scheduler": ["default"]}
    for point, row in EXTENSION_POINTS.items():
        spec, plugin, dist = pm.resolve(point)
        assert (spec.name, dist) == (row.default, "pdplug")
        assert plugin in DEFAULT_PLUGINS
    assert pm.names("kv_sender") == ["mooncake", "nixl"]
    assert pm.conflicts() == [] and pm.failed() == []


def test_discovery_and_entry_point_modules_import_nothing_heavy() -> None:
    code = textwrap.dedent(
        """
        import sys
        from pdplug import PluginManager
        pm = PluginManager(env={})
        assert len(pm.records) >= 5, pm.records
        heavy = sorted(m for m in ("torch", "triton", "nixl", "nixl_cu12", "mooncake")
                       if m in sys.modules)
        print(",".join(heavy) or "none")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "none"


def test_default_records_are_trylast_so_third_parties_run_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ep = third_party(monkeypatch, "acme-consensus", ConsensusSpec(name="acme", factory="x:y"))
    pm = PluginManager(with_defaults(ep), env={})
    impls = pm.pm.hook.pdplug_register_consensus.get_hookimpls()
    order = [i.plugin_name for i in reversed(impls)]  # call order
    assert order == ["acme-consensus", "pdplug-consensus"]
    assert [i.trylast for i in reversed(impls)] == [False, True]


def test_fake_distributions_through_importlib_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    """Guard: the manager's default discovery really goes through importlib.metadata."""
    import importlib.metadata as md

    from pdplug.testing import FakeDistribution

    install_module(
        monkeypatch,
        "hello_mod",
        pdplug_register_consensus=consensus_hook(ConsensusSpec(name="hello", factory="a:b")),
    )
    real = list(md.distributions())
    fake = FakeDistribution("pdplug-hello", "0.3.0", {"pdplug-hello": "hello_mod"})
    monkeypatch.setattr(md, "distributions", lambda **kw: iter([*real, fake]))
    pm = PluginManager(env={})
    rec = {r.name: r for r in pm.records}["pdplug-hello"]
    assert (rec.distribution, rec.version, rec.status) == ("pdplug-hello", "0.3.0", "loaded")
    assert pm.resolve("consensus", "hello")[2] == "pdplug-hello"


# --------------------------------------------------------------------------- override semantics


def test_declared_override_replaces_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    install_module(monkeypatch, "acme_impl", make=_make("acme"))
    ep = third_party(
        monkeypatch,
        "acme-consensus",
        ConsensusSpec(name="pp0", factory="acme_impl:make", overrides=True),
    )
    pm = PluginManager(with_defaults(ep), env={})
    assert pm.conflicts() == []
    spec, plugin, dist = pm.resolve("consensus")
    assert (spec.name, plugin, dist) == ("pp0", "acme-consensus", "acme-consensus")
    obj: Any = pm.make_consensus(CFG)
    assert obj.tag == "acme" and obj.config is CFG
    assert pm.overrides() == [("consensus", "pp0", "acme-consensus", "pdplug")]
    recs = {r.name: r for r in pm.records}
    assert recs["acme-consensus"].provides == {"consensus": ["pp0"]}
    assert recs["pdplug-consensus"].provides == {"consensus": ["ring"]}
    # the wrapped default stays reachable through the public API
    assert pm.overridden_factory("consensus", "pp0").__name__ == "make_pp0"
    with pytest.raises(UnknownComponentError, match="no override of consensus 'ring'"):
        pm.overridden_factory("consensus", "ring")


def test_override_wins_whatever_the_discovery_order(monkeypatch: pytest.MonkeyPatch) -> None:
    ep = third_party(
        monkeypatch, "acme-consensus", ConsensusSpec(name="pp0", factory="a:b", overrides=True)
    )
    for eps in ([ep, *discover_entry_points()], with_defaults(ep)):
        pm = PluginManager(eps, env={})
        assert pm.resolve("consensus")[2] == "acme-consensus"


def test_blocking_the_override_restores_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    ep = third_party(
        monkeypatch, "acme-consensus", ConsensusSpec(name="pp0", factory="a:b", overrides=True)
    )
    for blocked in ("acme-consensus", "ACME_Consensus", "acme.consensus"):  # PEP 503
        pm = PluginManager(with_defaults(ep), env={"PDPLUG_DISABLE_PLUGINS": f"x, {blocked}"})
        rec = {r.name: r for r in pm.records}["acme-consensus"]
        assert rec.status == "blocked" and rec.provides == {}
        assert pm.resolve("consensus")[1:] == ("pdplug-consensus", "pdplug")
        assert pm.pm.is_blocked("acme-consensus")


def test_blocking_a_default_removes_its_names(monkeypatch: pytest.MonkeyPatch) -> None:
    pm = PluginManager(env={"PDPLUG_DISABLE_PLUGINS": "pdplug_mooncake"})
    assert pm.names("kv_sender") == ["nixl"]
    with pytest.raises(UnknownComponentError) as e:
        pm.resolve("kv_sender", "mooncake")
    assert "Available: nixl" in str(e.value)


def test_undeclared_duplicate_names_both_distributions(monkeypatch: pytest.MonkeyPatch) -> None:
    ep = third_party(monkeypatch, "dup-consensus", ConsensusSpec(name="pp0", factory="a:b"))
    pm = PluginManager(with_defaults(ep), env={})
    with pytest.raises(DuplicateComponentError) as e:
        pm.make_consensus(CFG)
    msg = str(e.value)
    assert "pdplug (plugin 'pdplug-consensus')" in msg
    assert "dup-consensus (plugin 'dup-consensus')" in msg
    assert "PDPLUG_DISABLE_PLUGINS=dup-consensus" in msg
    assert pm.conflicts() == [msg]
    # other names still work; the conflicting name is listed under both claimants
    assert pm.resolve("consensus", "ring")[2] == "pdplug"
    recs = {r.name: r for r in pm.records}
    assert recs["dup-consensus"].provides == {"consensus": ["pp0"]}
    assert recs["pdplug-consensus"].provides == {"consensus": ["pp0", "ring"]}
    with pytest.raises(DuplicateComponentError, match="dup-consensus"):
        PluginManager(with_defaults(ep), env={}, strict=True)


def test_duplicate_against_an_override_names_both_third_parties(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    over = third_party(
        monkeypatch, "acme-consensus", ConsensusSpec(name="pp0", factory="a:b", overrides=True)
    )
    dup = third_party(monkeypatch, "dup-consensus", ConsensusSpec(name="pp0", factory="a:b"))
    twice = third_party(
        monkeypatch, "other-consensus", ConsensusSpec(name="pp0", factory="a:b", overrides=True)
    )
    messages = set()
    for eps in (with_defaults(over, dup), with_defaults(dup, over), [dup, over]):
        pm = PluginManager(eps, env={})
        with pytest.raises(DuplicateComponentError) as e:
            pm.resolve("consensus")
        assert "acme-consensus (plugin" in str(e.value)
        assert "dup-consensus (plugin" in str(e.value)
        messages.add(str(e.value)) if len(eps) > 2 else None
    assert len(messages) == 1, "the message must not depend on discovery order"
    pm = PluginManager(with_defaults(over, twice), env={})
    with pytest.raises(DuplicateComponentError, match="two records declare overrides"):
        pm.resolve("consensus")


def test_duplicate_inside_one_kind_of_record_across_points_is_independent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same name at two different extension points is no conflict."""
    install_module(
        monkeypatch,
        "both_mod",
        pdplug_register_kv_senders=kv_hook(KVSenderSpec(name="pp0", factory="a:b")),
    )
    ep = fake_entry_point("both", "both_mod", dist="both")
    pm = PluginManager(with_defaults(ep), env={})
    assert pm.conflicts() == []
    assert pm.resolve("kv_sender", "pp0")[2] == "both"
    assert pm.resolve("consensus", "pp0")[2] == "pdplug"


# --------------------------------------------------------------------------- unknown / failed


def _broken_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> Any:
    mod = name.replace("-", "_")
    (tmp_path / f"{mod}.py").write_text("raise RuntimeError('boom: missing libfoo.so')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return fake_entry_point(name, mod, dist=name, version="0.9")


def test_unknown_name_lists_alternatives_and_failed_plugins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = _broken_plugin(tmp_path, monkeypatch, "broken-thing")
    pm = PluginManager(with_defaults(broken), env={"PDPLUG_CONSENSUS": "raft"})
    with pytest.raises(UnknownComponentError) as e:
        pm.make_consensus(CFG)
    msg = str(e.value)
    assert "no consensus named 'raft' (set by PDPLUG_CONSENSUS)" in msg
    assert "Available: pp0, ring" in msg
    assert "broken-thing (broken-thing): failed: import failed: RuntimeError: boom" in msg
    assert isinstance(e.value, LookupError)


def test_failed_import_is_listed_then_reraised_when_selected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    broken = _broken_plugin(tmp_path, monkeypatch, "raft-consensus")
    pm = PluginManager(with_defaults(broken), env={})
    rec = {r.name: r for r in pm.records}["raft-consensus"]
    assert rec.status.startswith("failed: ")
    assert "RuntimeError: boom: missing libfoo.so" in rec.status
    assert "'raft-consensus' from raft-consensus 0.9 failed" in caplog.text
    # the defaults still work
    assert pm.resolve("consensus")[2] == "pdplug"
    with pytest.raises(PluginError) as e:
        pm.resolve("consensus", "raft-consensus")
    assert "plugin 'raft-consensus' (raft-consensus 0.9) failed" in str(e.value)
    assert isinstance(e.value.__cause__, RuntimeError)


def test_strict_mode_makes_a_failed_import_fatal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = _broken_plugin(tmp_path, monkeypatch, "raft-consensus")
    for kwargs in ({"env": {"PDPLUG_STRICT_PLUGINS": "1"}}, {"env": {}, "strict": True}):
        with pytest.raises(PluginError) as e:
            PluginManager(with_defaults(broken), **kwargs)
        assert "'raft-consensus' from raft-consensus 0.9" in str(e.value)
        assert "PDPLUG_STRICT_PLUGINS=1" in str(e.value)
        assert isinstance(e.value.__cause__, RuntimeError)


def test_a_raising_registry_hook_is_isolated_like_an_import_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    @hookimpl
    def pdplug_register_consensus() -> Any:
        raise ValueError("bad record")

    @hookimpl
    def pdplug_register_kv_senders() -> Any:
        yield KVSenderSpec(name="flaky", factory="a:b")

    install_module(
        monkeypatch,
        "flaky_mod",
        pdplug_register_consensus=pdplug_register_consensus,
        pdplug_register_kv_senders=pdplug_register_kv_senders,
    )
    ep = fake_entry_point("flaky", "flaky_mod", dist="flaky")
    pm = PluginManager(with_defaults(ep), env={})
    rec = {r.name: r for r in pm.records}["flaky"]
    assert rec.status == "failed: pdplug_register_consensus raised: ValueError: bad record"
    assert "flaky" not in pm.names("kv_sender"), "a failed plugin contributes nothing"
    with pytest.raises(PluginError, match="bad record"):
        PluginManager(with_defaults(ep), env={}, strict=True)


def test_wrong_record_type_and_unknown_hook_fail_the_plugin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    install_module(
        monkeypatch,
        "wrong_mod",
        pdplug_register_consensus=consensus_hook(KVSenderSpec(name="x", factory="a:b")),  # type: ignore[arg-type]
    )

    @hookimpl
    def pdplug_register_consensuss() -> Any:  # typo
        yield ConsensusSpec(name="typo", factory="a:b")

    install_module(monkeypatch, "typo_mod", pdplug_register_consensuss=pdplug_register_consensuss)
    eps = with_defaults(
        fake_entry_point("wrong", "wrong_mod", dist="wrong"),
        fake_entry_point("typo", "typo_mod", dist="typo"),
    )
    pm = PluginManager(eps, env={})
    recs = {r.name: r for r in pm.records}
    assert recs["wrong"].status == (
        "failed: pdplug_register_consensus yielded KVSenderSpec, expected ConsensusSpec"
    )
    assert recs["typo"].status.startswith("failed: registration failed: PluginError: plugin 'typo'")
    assert "unknown hooks ['pdplug_register_consensuss']" in recs["typo"].status
    assert pm.names("consensus") == ["pp0", "ring"]


# --------------------------------------------------------------------------- switches


def test_autoload_off_keeps_defaults_and_allowlisted_plugins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a = third_party(monkeypatch, "alpha-consensus", ConsensusSpec(name="alpha", factory="a:b"))
    b = third_party(monkeypatch, "beta-consensus", ConsensusSpec(name="beta", factory="a:b"))
    eps = with_defaults(a, b)

    pm = PluginManager(eps, env={"PDPLUG_DISABLE_PLUGIN_AUTOLOAD": "1"})
    st = {r.name: r.status for r in pm.records}
    assert st["alpha-consensus"] == st["beta-consensus"] == "skipped: autoload off"
    assert all(st[n] == "loaded" for n in DEFAULT_PLUGINS)
    assert pm.names("consensus") == ["pp0", "ring"]

    pm = PluginManager(
        eps, env={"PDPLUG_DISABLE_PLUGIN_AUTOLOAD": "true", "PDPLUG_PLUGINS": "Alpha_Consensus"}
    )
    st = {r.name: r.status for r in pm.records}
    assert st["alpha-consensus"] == "loaded"
    assert st["beta-consensus"] == "skipped: not in PDPLUG_PLUGINS"
    assert pm.names("consensus") == ["alpha", "pp0", "ring"]

    # an allow list alone restricts third parties (vLLM's VLLM_PLUGINS), never the defaults
    pm = PluginManager(eps, env={"PDPLUG_PLUGINS": "beta-consensus"})
    st = {r.name: r.status for r in pm.records}
    assert st["alpha-consensus"] == "skipped: not in PDPLUG_PLUGINS"
    assert pm.names("consensus") == ["beta", "pp0", "ring"]

    # the block list beats the allow list
    pm = PluginManager(
        eps, env={"PDPLUG_PLUGINS": "beta-consensus", "PDPLUG_DISABLE_PLUGINS": "beta-consensus"}
    )
    assert {r.name: r.status for r in pm.records}["beta-consensus"] == "blocked"
    pm = PluginManager(eps, env={}, allow=["beta-consensus"], block=["beta-consensus"])
    assert {r.name: r.status for r in pm.records}["beta-consensus"] == "blocked"


def test_allowlisted_plugin_that_is_not_installed(caplog: pytest.LogCaptureFixture) -> None:
    pm = PluginManager(env={"PDPLUG_PLUGINS": "ghost"})
    assert "PDPLUG_PLUGINS names ['ghost']" in caplog.text
    assert pm.names("consensus") == ["pp0", "ring"]
    with pytest.raises(PluginError, match="ghost"):
        PluginManager(env={"PDPLUG_PLUGINS": "ghost", "PDPLUG_STRICT_PLUGINS": "1"})


def test_explicit_arguments_beat_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    a = third_party(monkeypatch, "alpha-consensus", ConsensusSpec(name="alpha", factory="a:b"))
    eps = with_defaults(a)
    env = {"PDPLUG_DISABLE_PLUGIN_AUTOLOAD": "1", "PDPLUG_CONSENSUS": "ring"}
    assert PluginManager(eps, env=env, autoload=True).names("consensus") == [
        "alpha",
        "pp0",
        "ring",
    ]
    assert PluginManager(eps, env={}, autoload=False).names("consensus") == ["pp0", "ring"]
    pm = PluginManager(eps, env=env)
    assert pm.selected("consensus") == "ring"  # env beats the default
    pm = PluginManager(eps, env=env, select={"consensus": "pp0"})
    assert pm.selected("consensus") == "pp0"  # select= beats the env
    assert pm.selected("consensus", "alpha") == "alpha"  # the call beats select=
    assert pm.selected("scheduler") == "default"
    with pytest.raises(ValueError, match="unknown extension point 'planner'"):
        PluginManager(eps, env={}, select={"planner": "x"})


def test_env_selection_drives_the_facade(monkeypatch: pytest.MonkeyPatch) -> None:
    install_module(monkeypatch, "sel_impl", make=_make("alpha"))
    a = third_party(
        monkeypatch, "alpha-consensus", ConsensusSpec(name="alpha", factory="sel_impl:make")
    )
    pm = PluginManager(with_defaults(a), env={"PDPLUG_CONSENSUS": " alpha "})
    obj: Any = pm.make_consensus(CFG)
    assert obj.tag == "alpha"
    assert pm.describe("consensus") == {
        "name": "alpha",
        "plugin": "alpha-consensus",
        "distribution": "alpha-consensus",
        "version": "1.2.3",
    }


def test_bad_factory_reference_is_a_plugin_error(monkeypatch: pytest.MonkeyPatch) -> None:
    a = third_party(
        monkeypatch,
        "alpha-consensus",
        ConsensusSpec(name="alpha", factory="no_such_module_xyz:make"),
        ConsensusSpec(name="beta", factory="no-colon"),
    )
    pm = PluginManager(with_defaults(a), env={})
    with pytest.raises(PluginError, match="'no_such_module_xyz:make' failed to load"):
        pm.make_consensus(CFG, name="alpha")
    with pytest.raises(PluginError, match="not of the form 'module:attr'"):
        pm.make_consensus(CFG, name="beta")


def test_the_same_distribution_seen_twice_is_listed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    a = third_party(monkeypatch, "alpha-consensus", ConsensusSpec(name="alpha", factory="a:b"))
    pm = PluginManager(with_defaults(a, a), env={})
    assert [r.name for r in pm.records].count("alpha-consensus") == 1
    assert pm.conflicts() == []


# --------------------------------------------------------------------------- in-process + hooks


def test_testing_helpers_register_and_unregister(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = install_module(
        monkeypatch,
        "inproc_mod",
        pdplug_register_consensus=consensus_hook(ConsensusSpec(name="inproc", factory="a:b")),
    )
    pm = make_plugin_manager(("inproc", mod))
    assert pm.resolve("consensus", "inproc")[1:] == ("inproc", "<in-process>")
    with pytest.raises(PluginError, match="already registered"):
        pm.register(mod, name="inproc")
    pm.unregister("inproc")
    assert pm.names("consensus") == ["pp0", "ring"]
    pm.register(mod, name="again", distribution="my-dist")
    assert pm.resolve("consensus", "inproc")[2] == "my-dist"
    with pytest.raises(TypeError, match="pass \\(name, plugin\\)"):
        make_plugin_manager(object())
    empty = make_plugin_manager(entry_points=[])
    empty.register(mod, name="late")
    assert empty.names("consensus") == ["inproc"]


def test_plugin_manager_fixture_is_fresh(plugin_manager: PluginManager) -> None:
    assert plugin_manager.names("consensus") == ["pp0", "ring"]
    assert plugin_manager.strict
    assert plugin_manager.autoload is False


def test_check_compat_joins_layout_checks_and_plugin_vetoes() -> None:
    class Veto:
        @hookimpl
        def pdplug_check_compat(self, local: Any, remote: Any) -> list[str]:
            return [f"backend: local {local.backend!r} vs remote {remote.backend!r}"]

    pm = make_plugin_manager(("veto", Veto()))
    a, b = fake_layout(page_size=16), fake_layout(page_size=32)
    got = pm.check_compat(fake_peer(a), fake_peer(b, "decode"))
    assert got == [
        "page_size: local 16 vs remote 32 tokens",
        "backend: local '' vs remote ''",
    ]
    assert make_plugin_manager().check_compat(fake_peer(a), fake_peer(a, "decode")) == []


def test_emit_isolates_observers_and_configure_is_historic(
    caplog: pytest.LogCaptureFixture,
) -> None:
    seen: list[str] = []

    class Good:
        @hookimpl
        def pdplug_on_event(self, event: PdplugEvent) -> None:
            seen.append(event.kind)

        @hookimpl
        def pdplug_configure(self, config: Any) -> None:
            seen.append(f"configured {config['consensus']}")

    class Bad:
        @hookimpl(tryfirst=True)
        def pdplug_on_event(self, event: PdplugEvent) -> None:
            raise RuntimeError("observer down")

    pm = make_plugin_manager(("bad", Bad()))
    pm.configure({"consensus": "pp0"})
    pm.register(Good(), name="good")  # registered late: historic replay
    pm.emit(PdplugEvent(kind="decision", source="pp0"))
    assert seen == ["configured pp0", "decision"]
    assert "observer 'bad' failed on decision" in caplog.text


def test_a_hookimpl_with_unknown_arguments_fails_registration(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    @hookimpl
    def pdplug_on_event(event: Any, verbosity: int) -> None:  # no such spec argument
        return None

    install_module(monkeypatch, "badargs_mod", pdplug_on_event=pdplug_on_event)
    ep = fake_entry_point("badargs", "badargs_mod", dist="badargs", version="0.1")
    pm = PluginManager(with_defaults(ep), env={})
    status = {r.name: r for r in pm.records}["badargs"].status
    assert status.startswith("failed: registration failed: PluginValidationError")
    assert "verbosity" in status
    assert pm.pm.get_plugin("badargs") is None
    with pytest.raises(PluginError, match=r"'badargs' from badargs 0\.1 failed: registration"):
        PluginManager(with_defaults(ep), env={}, strict=True)


def test_a_refused_in_process_plugin_leaves_no_trace() -> None:
    class Typo:
        @hookimpl
        def pdplug_on_evnt(self, event: Any) -> None:
            return None

    pm = make_plugin_manager()
    with pytest.raises(PluginError, match=r"unknown hooks \['pdplug_on_evnt'\]"):
        pm.register(Typo(), name="typo")
    assert pm.pm.get_plugin("typo") is None
    assert "typo" not in {r.name for r in pm.records}
    pm.register(object(), name="typo")  # the name is free again


# ------------------------------------------------------------------- pluggy calls every hook


def test_every_hook_goes_through_pluggy_so_monitoring_sees_it() -> None:
    seen: list[tuple[str, list[str]]] = []

    class Everything:
        @hookimpl
        def pdplug_register_consensus(self) -> Any:
            yield ConsensusSpec(name="mon", factory="a:b")

        @hookimpl
        def pdplug_check_compat(self, local: Any, remote: Any) -> list[str]:
            return []

        @hookimpl
        def pdplug_on_event(self, event: PdplugEvent) -> None:
            return None

        @hookimpl
        def pdplug_configure(self, config: Any) -> None:
            return None

    pm = make_plugin_manager()
    undo = pm.pm.add_hookcall_monitoring(
        lambda name, impls, kwargs: seen.append((name, [i.plugin_name for i in impls])),
        lambda outcome, name, impls, kwargs: None,
    )
    try:
        pm.register(Everything(), name="everything")  # rebuilds the registry
        peer = fake_peer(fake_layout())
        pm.check_compat(peer, peer)
        pm.emit(PdplugEvent(kind="decision", source="pp0"))
        pm.configure({"consensus": "mon"})
    finally:
        undo()
    assert {name for name, _ in seen} == {
        "pdplug_register_consensus",
        "pdplug_register_kv_senders",
        "pdplug_register_pack_planners",
        "pdplug_register_schedulers",
        "pdplug_check_compat",
        "pdplug_on_event",
        "pdplug_configure",
    }
    # registry hooks are called once per plugin, so each record is attributed to its plugin
    registry_calls = [impls for name, impls in seen if name == "pdplug_register_consensus"]
    assert registry_calls == [["everything"], ["pdplug-consensus"]]  # call order: trylast last
    assert pm.resolve("consensus", "mon")[1] == "everything"


@pytest.mark.parametrize("kind", ["wrapper", "hookwrapper"])
def test_a_wrapper_of_a_pdplug_hook_is_refused_naming_plugin_and_hook(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    @hookimpl(**{kind: True})
    def pdplug_on_event(event: Any) -> Any:
        yield

    class Wrapping:
        pass

    obj = Wrapping()
    obj.pdplug_on_event = pdplug_on_event  # type: ignore[attr-defined]
    pm = make_plugin_manager()
    with pytest.raises(PluginError) as e:
        pm.register(obj, name="wrapping")
    assert f"plugin 'wrapping' implements pdplug_on_event with {kind}=True" in str(e.value)
    assert pm.pm.get_plugin("wrapping") is None

    install_module(monkeypatch, "wrapping_mod", pdplug_on_event=pdplug_on_event)
    ep = fake_entry_point("wrapping-ep", "wrapping_mod", dist="wrapping-dist", version="0.2")
    pm = PluginManager(with_defaults(ep), env={})
    status = {r.name: r for r in pm.records}["wrapping-ep"].status
    assert status.startswith("failed: registration failed: PluginError: plugin 'wrapping-ep'")
    assert f"pdplug_on_event with {kind}=True" in status
    with pytest.raises(PluginError, match=r"'wrapping-ep' from wrapping-dist 0\.2 failed"):
        PluginManager(with_defaults(ep), env={}, strict=True)


def test_sessions_are_built_with_this_managers_compat_and_emit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """issue 10 item 7: no hidden process-wide manager behind a session's vetoes/observers."""
    built: dict[str, dict[str, Any]] = {}

    def sender(config: Any, planner: Any, packer: Any, **kw: Any) -> Any:
        built["sender"] = kw
        return object()

    def receiver(config: Any, **kw: Any) -> Any:
        built["receiver"] = kw
        return object()

    install_module(monkeypatch, "bound_tx", sender=sender, receiver=receiver)
    install_module(
        monkeypatch,
        "bound_mod",
        pdplug_register_kv_senders=kv_hook(
            KVSenderSpec(
                name="bound", factory="bound_tx:sender", receiver_factory="bound_tx:receiver"
            )
        ),
    )
    pm = PluginManager(with_defaults(fake_entry_point("bound", "bound_mod", dist="bound")), env={})
    from pdplug import KVConfig

    cfg = KVConfig(instance="p", role="prefill", layout=fake_layout())
    pm.make_kv_sender(cfg, planner=object(), name="bound")  # type: ignore[arg-type]
    pm.make_kv_receiver(cfg, name="bound")
    for side in ("sender", "receiver"):
        assert built[side]["compat"] == pm.check_compat, side
        assert built[side]["emit"] == pm.emit, side


# ------------------------------------------------------------------- one table, small modules


def test_one_extension_point_table_read_by_the_manager_the_cli_and_the_host() -> None:
    from pdplug.cli import plugins
    from pdplug.manager import ExtensionPoint, extension_point

    assert list(EXTENSION_POINTS) == ["consensus", "kv_sender", "pack_planner", "scheduler"]
    kv = EXTENSION_POINTS["kv_sender"]
    assert isinstance(kv, ExtensionPoint)
    assert (kv.hook, kv.spec, kv.env, kv.default) == (
        "pdplug_register_kv_senders",
        KVSenderSpec,
        "PDPLUG_KV_SENDER",
        "nixl",
    )
    assert kv.factories == ("factory", "receiver_factory") and kv.option == "--kv-sender"
    assert set(EXTENSION_POINTS) <= {o.name for o in plugins.params}
    with pytest.raises(ValueError, match="unknown extension point 'planner'"):
        extension_point("planner")
    pytest.importorskip("torch")  # the reference host needs it
    from pdplug_host.cli import demo
    from pdplug_host.worker import POINTS

    assert tuple(EXTENSION_POINTS) == POINTS
    host_options = {opt for o in demo.params for opt in o.opts}
    assert {p.option for p in EXTENSION_POINTS.values()} <= host_options


def test_manager_modules_are_small_and_say_their_one_job() -> None:
    import importlib

    for name in ("discovery", "registry", "facade", "points", "listing", "default"):
        mod = importlib.import_module(f"pdplug.manager.{name}")
        lines = Path(str(mod.__file__)).read_text().count("\n")
        assert lines < 330, (name, lines)
        first = (mod.__doc__ or "").splitlines()[0]
        assert len(first) > 30 and ":" in first, (name, first)


def test_emit_reaches_observers_registered_after_the_first_event() -> None:
    seen: list[str] = []

    class Late:
        @hookimpl
        def pdplug_on_event(self, event: PdplugEvent) -> None:
            seen.append(event.kind)

    pm = make_plugin_manager()
    pm.emit(PdplugEvent(kind="first", source="x"))
    pm.register(Late(), name="late")
    pm.emit(PdplugEvent(kind="second", source="x"))
    pm.unregister("late")
    pm.emit(PdplugEvent(kind="third", source="x"))
    assert seen == ["second"]


def test_a_planner_name_passed_as_config_is_a_type_error_naming_the_keyword() -> None:
    """``make_pack_planner("tp")`` passed the name as ``config`` and failed deep inside the
    planner with an ``AttributeError``; it is refused at once, pointing at ``name=``."""
    from pdplug import PluginManager

    with pytest.raises(TypeError, match=r"config must be a PlannerConfig or None, got str "
                                        r"\(to select a planner: name='tp'\)"):  # fmt: skip
        PluginManager().make_pack_planner("tp")  # type: ignore[arg-type]
    assert PluginManager().make_pack_planner(name="tp") is not None
