"""The one lazy SDK import: the module when it is there, the install hint when it is not."""

from __future__ import annotations

import pytest

from spottrain.lazy_import import install_hint, lazy_import


class _MissingSdk(ImportError):
    pass


def test_an_installed_module_is_returned() -> None:
    assert lazy_import("json", needs="x needs json", extra="aws").dumps([1]) == "[1]"


def test_a_missing_module_names_the_extra_to_install() -> None:
    with pytest.raises(ImportError) as caught:
        lazy_import("no_such_sdk_anywhere", needs="the thing needs no_such_sdk", extra="gcp")
    assert str(caught.value) == "the thing needs no_such_sdk: pip install 'spottrain[gcp]'"
    assert isinstance(caught.value.__cause__, ImportError)


def test_the_error_class_and_the_cause_text_can_be_chosen() -> None:
    with pytest.raises(_MissingSdk) as caught:
        lazy_import(
            "no_such_sdk_anywhere", needs="n", extra="aws", error=_MissingSdk, show_cause=True
        )
    assert str(caught.value).startswith(f"n: {install_hint('aws')} (No module named ")
