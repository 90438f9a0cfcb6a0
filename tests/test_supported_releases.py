"""The supported megatron-core releases: anything outside the range is refused at ``import adapter``,
before any patch goes in, in one line naming the checked releases; ADAPTER_ALLOW_UNTESTED_MEGATRON=1 lets a
user try it, with a warning."""

from __future__ import annotations

import pytest

import adapter  # noqa: F401 - first, as every user of the patch table
import patches
from adapter.registry import ALLOW_UNTESTED_ENV, PatchRegistry, PatchVersionError


def _registry(version: str) -> PatchRegistry:
    return PatchRegistry(backend=lambda: "cpu", megatron_version=lambda: version)


@pytest.mark.parametrize("version", ["0.16.1", "0.17.1", "0.18.0", "0.19.2"])
def test_releases_in_the_range_register_without_a_word(version, monkeypatch, recwarn):
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    _registry(version).check_release(patches.CHECKED_MEGATRON_CORE, patches.CHECKED_ON)
    assert not recwarn.list


@pytest.mark.parametrize("version", ["0.16.0", "0.20.0", "0.19.3rc0"])
def test_a_release_outside_the_range_is_refused_in_one_line(version, monkeypatch):
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(PatchVersionError) as refused:
        _registry(version).check_release(patches.CHECKED_MEGATRON_CORE, patches.CHECKED_ON)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"megatron-core {version} is installed; the adapter supports "
                              "megatron-core>=0.16.1,<=0.19.2 (checked on 0.16.1, ")
    assert f"{ALLOW_UNTESTED_ENV}=1" in message


def test_the_environment_variable_tries_it_with_a_warning(monkeypatch):
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")
    with pytest.warns(UserWarning, match=r"megatron-core 0\.20\.0 is installed.*trying it anyway"):
        _registry("0.20.0").check_release(patches.CHECKED_MEGATRON_CORE, patches.CHECKED_ON)
