"""``cpu_runtime.megatron_training``: the megatron-core wheel's ``megatron.training`` on Python 3.11.

The import of the real ``megatron.training`` with these shims (and the dataset helpers' build
skipped) is checked in ``test_runtime.py``, in a fresh interpreter; here the Python-version
shim on its own.
"""

from __future__ import annotations

import sys
import typing

import pytest

from elastic_moe_plugin.cpu_runtime import megatron_training


@pytest.fixture(autouse=True)
def _off():
    megatron_training.disable()
    yield
    megatron_training.disable()


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="typing.override exists from Python 3.12")
def test_typing_override_is_the_backport_while_enabled():
    import typing_extensions

    assert not hasattr(typing, "override")
    with megatron_training.enabled():
        assert typing.override is typing_extensions.override
        megatron_training.enable()  # idempotent
        assert megatron_training.is_enabled()
    assert not hasattr(typing, "override") and not megatron_training.is_enabled()


@pytest.mark.skipif(sys.version_info < (3, 12), reason="Python 3.12+ only")
def test_python_312_keeps_its_own_typing_override():  # pragma: no cover - CI runs 3.11
    own = typing.override
    with megatron_training.enabled():
        assert typing.override is own
