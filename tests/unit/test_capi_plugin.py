"""Which PJRT plugin the C API runtime loads (runtime/capi.py plugin_path): a path given, else
$TLALOC_PJRT_PLUGIN, else the installed xla-cpu-pjrt wheel's library; a missing one named with
where it came from. No plugin is loaded here."""

from __future__ import annotations

import pytest

from triton_tlaloc.runtime import capi


def test_a_given_path_then_the_environment_then_the_installed_wheel(tmp_path, monkeypatch):
    given, from_env = tmp_path / "given.so", tmp_path / "env.so"
    given.write_bytes(b"")
    from_env.write_bytes(b"")
    monkeypatch.setenv(capi.PLUGIN_ENV, str(from_env))
    assert capi.plugin_path(given) == given
    assert capi.plugin_path() == from_env
    monkeypatch.delenv(capi.PLUGIN_ENV)
    wheel = capi.plugin_path()  # (the test extras install xla-cpu-pjrt)
    assert wheel.name == "xla_cpu_pjrt.so" and wheel.is_file()


def test_a_missing_plugin_is_named_with_where_it_came_from(tmp_path, monkeypatch):
    with pytest.raises(capi.PluginError, match=r"nowhere\.so \(from --plugin .*\): no such file"):
        capi.plugin_path(tmp_path / "nowhere.so")
    monkeypatch.setenv(capi.PLUGIN_ENV, str(tmp_path / "gone.so"))
    with pytest.raises(capi.PluginError, match=r"from TLALOC_PJRT_PLUGIN=.*gone\.so"):
        capi.plugin_path()
    monkeypatch.delenv(capi.PLUGIN_ENV)
    monkeypatch.setattr(capi, "CPU_WHEEL", ("no_such_plugin_wheel.x", "x.so"))
    with pytest.raises(capi.PluginError, match=r"no PJRT plugin: give one .*triton-tlaloc\[capi\]"):
        capi.plugin_path()
