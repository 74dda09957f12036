"""dkv.gil: the GIL switch interval is lowered while held, never raised, and put back by the last holder."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

from dkv import gil
from dkv.errors import ConfigError


@pytest.fixture(autouse=True)
def interpreter_interval() -> Iterator[float]:
    """Each test starts from CPython's default with no holder, and leaves the interpreter as it found it."""
    found = sys.getswitchinterval()
    assert gil._holders == 0, "a holder leaked from an earlier test"  # noqa: SLF001
    sys.setswitchinterval(0.005)
    yield 0.005
    while gil._holders:  # noqa: SLF001 - a failed test's holders
        gil.release_switch_interval()
    sys.setswitchinterval(found)


def test_a_holder_lowers_the_interval_and_the_last_release_puts_it_back() -> None:
    gil.hold_switch_interval(0.0005)
    assert sys.getswitchinterval() == pytest.approx(0.0005)
    gil.hold_switch_interval(0.0005)
    gil.release_switch_interval()
    assert sys.getswitchinterval() == pytest.approx(0.0005), "a holder is left: the interval stays lowered"
    gil.release_switch_interval()
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_an_interval_already_shorter_is_never_raised_nor_touched_on_release() -> None:
    sys.setswitchinterval(0.0001)
    gil.hold_switch_interval(0.0005)
    assert sys.getswitchinterval() == pytest.approx(0.0001)
    gil.release_switch_interval()
    assert sys.getswitchinterval() == pytest.approx(0.0001)


def test_a_holder_asking_for_less_lowers_it_further_and_the_first_value_comes_back() -> None:
    gil.hold_switch_interval(0.001)
    gil.hold_switch_interval(0.0002)
    assert sys.getswitchinterval() == pytest.approx(0.0002)
    gil.release_switch_interval()
    gil.release_switch_interval()
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_an_interval_someone_else_set_meanwhile_is_left_as_they_set_it() -> None:
    gil.hold_switch_interval(0.0005)
    sys.setswitchinterval(0.002)  # the engine's own choice, made while dKV held it
    gil.release_switch_interval()
    assert sys.getswitchinterval() == pytest.approx(0.002)


def test_a_holder_of_none_counts_but_leaves_the_interval() -> None:
    gil.hold_switch_interval(None)
    assert sys.getswitchinterval() == pytest.approx(0.005)
    gil.hold_switch_interval(0.0005)
    gil.release_switch_interval()
    assert sys.getswitchinterval() == pytest.approx(0.0005), "the None holder still holds"
    gil.release_switch_interval()
    assert sys.getswitchinterval() == pytest.approx(0.005)


@pytest.mark.parametrize("bad", [0, -0.001, float("nan"), float("inf"), True, "0.001"])
def test_an_unusable_interval_is_a_config_error_and_changes_nothing(bad: object) -> None:
    with pytest.raises(ConfigError, match="switch interval"):
        gil.hold_switch_interval(bad)  # type: ignore[arg-type]
    assert gil._holders == 0 and sys.getswitchinterval() == pytest.approx(0.005)  # noqa: SLF001


@pytest.mark.parametrize(("text", "seconds"), [(None, gil.DEFAULT_SWITCH_INTERVAL), ("", gil.DEFAULT_SWITCH_INTERVAL),
                                                ("off", None), (" OFF ", None), ("0.0002", 0.0002), ("1e-3", 0.001)])
def test_the_environment_setting_parses_seconds_or_off(text: str | None, seconds: float | None) -> None:
    assert gil.parse_switch_interval(text) == seconds


@pytest.mark.parametrize("text", ["fast", "0", "-1", "nan", "inf"])
def test_a_garbled_environment_setting_says_what_to_give(text: str) -> None:
    with pytest.raises(ConfigError, match=f"DKV_GIL_SWITCH_INTERVAL={text!r}: give"):
        gil.parse_switch_interval(text)


def test_a_forked_child_holds_nothing_and_starts_from_the_interval_found() -> None:
    gil.hold_switch_interval(0.0005)
    pid = os.fork()
    if pid == 0:  # the child: no connector came along
        ok = gil._holders == 0 and abs(sys.getswitchinterval() - 0.005) < 1e-9  # noqa: SLF001
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child kept the parent's hold or its lowered interval"
    assert sys.getswitchinterval() == pytest.approx(0.0005), "the parent still holds"
    gil.release_switch_interval()
