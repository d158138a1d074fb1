"""Settings parsers: a bad environment value stops the start with a message that
names the variable."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
from django.core.exceptions import ImproperlyConfigured

from portal.settings_env import (
    envbool,
    envchoice,
    envfloat,
    envfloat_or_none,
    envint,
    envlist,
    envnetworks,
    envsecret,
    envstr,
    envurl,
)

if TYPE_CHECKING:
    from pathlib import Path

VAR = "GPULAB_TEST_SETTING"


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (VAR, f"{VAR}_FILE"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("1", True),
        ("TRUE", True),
        (" yes ", True),
        ("on", True),
        ("0", False),
        ("false", False),
        ("No", False),
        ("off", False),
        ("", False),
    ],
)
def test_it_parses_booleans(
    monkeypatch: pytest.MonkeyPatch, value: str, *, expected: bool
) -> None:
    monkeypatch.setenv(VAR, value)

    assert envbool(VAR, default=not expected) is expected


def test_it_defaults_an_unset_boolean() -> None:
    assert envbool(VAR, default=True) is True
    assert envbool(VAR, default=False) is False


@pytest.mark.parametrize("value", ["maybe", "2", "yess"])
def test_it_refuses_a_bad_boolean(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(VAR, value)

    with pytest.raises(ImproperlyConfigured, match=f"{VAR}='{value}' is not a boolean"):
        envbool(VAR, default=False)


def test_it_parses_an_integer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(VAR, " 42 ")

    assert envint(VAR, 7, minimum=1) == 42


def test_it_defaults_an_empty_integer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(VAR, " ")

    assert envint(VAR, 7) == 7


@pytest.mark.parametrize("value", ["ten", "1.5", "0x10", "1e3"])
def test_it_refuses_a_bad_integer(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(VAR, value)

    with pytest.raises(ImproperlyConfigured, match=f"{VAR}=.* is not an integer"):
        envint(VAR, 1)


def test_it_refuses_an_integer_below_the_minimum(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(VAR, "4")

    with pytest.raises(ImproperlyConfigured, match=f"{VAR}=4 must be at least 5"):
        envint(VAR, 60, minimum=5)


def test_it_parses_a_float(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(VAR, "0.5")

    assert envfloat(VAR, 5.0, minimum=0.5) == 0.5


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("fast", "is not a number"),
        ("nan", "is not a finite number"),
        ("inf", "is not a finite number"),
        ("-inf", "is not a finite number"),
    ],
)
def test_it_refuses_a_bad_float(
    monkeypatch: pytest.MonkeyPatch, value: str, says: str
) -> None:
    monkeypatch.setenv(VAR, value)

    with pytest.raises(ImproperlyConfigured, match=f"{VAR}=.* {says}"):
        envfloat(VAR, 1.0)


def test_it_refuses_a_float_below_the_minimum(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(VAR, "0.1")

    with pytest.raises(ImproperlyConfigured, match=f"{VAR}=0.1 must be at least 0.5"):
        envfloat(VAR, 5.0, minimum=0.5)


@pytest.mark.parametrize(("value", "expected"), [("", "a"), ("b", "b"), (" b ", "b")])
def test_it_takes_one_of_the_choices(
    monkeypatch: pytest.MonkeyPatch, value: str, expected: str
) -> None:
    monkeypatch.setenv(VAR, value)

    assert envchoice(VAR, "a", ("a", "b")) == expected


def test_it_refuses_a_value_outside_the_choices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(VAR, "B")

    with pytest.raises(ImproperlyConfigured, match=f"{VAR}='B' is not one of: a, b"):
        envchoice(VAR, "a", ("a", "b"))


def test_it_splits_a_list_dropping_empty_items(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(VAR, " a.example, ,b.example,")

    assert envlist(VAR, ["default"]) == ["a.example", "b.example"]


def test_it_defaults_an_unset_list() -> None:
    assert envlist(VAR, ["localhost"]) == ["localhost"]


def test_it_requires_a_string_without_default() -> None:
    with pytest.raises(ImproperlyConfigured, match=f"{VAR} is not set"):
        envstr(VAR)


def test_it_reads_a_secret_from_its_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n", encoding="utf-8")
    monkeypatch.setenv(VAR, "from-env")
    monkeypatch.setenv(f"{VAR}_FILE", str(secret))

    assert envsecret(VAR) == "s3cret"


def test_it_reads_a_secret_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(VAR, "from-env")

    assert envsecret(VAR) == "from-env"


def test_it_refuses_an_unreadable_secret_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    missing = tmp_path / "nope"
    monkeypatch.setenv(f"{VAR}_FILE", str(missing))

    with pytest.raises(ImproperlyConfigured, match=f"{VAR}_FILE=.* cannot be read"):
        envsecret(VAR)


def test_it_refuses_an_empty_secret_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    empty = tmp_path / "empty"
    empty.write_text("  \n", encoding="utf-8")
    monkeypatch.setenv(f"{VAR}_FILE", str(empty))

    with pytest.raises(ImproperlyConfigured, match=f"{VAR}_FILE=.* is empty"):
        envsecret(VAR)


def test_it_requires_a_secret_without_default() -> None:
    with pytest.raises(ImproperlyConfigured, match=f"{VAR} is not set"):
        envsecret(VAR)


def test_it_accepts_a_url_with_an_allowed_scheme(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(VAR, " redis://127.0.0.1:6379/0 ")

    assert envurl(VAR, ("redis", "unix")) == "redis://127.0.0.1:6379/0"


def test_it_explains_a_missing_url() -> None:
    with pytest.raises(ImproperlyConfigured, match=f"{VAR} is not set") as caught:
        envurl(VAR, ("postgres",))

    assert "postgres://" in str(caught.value)


@pytest.mark.parametrize(
    ("value", "got"),
    [("http://x", "scheme 'http'"), ("127.0.0.1:6379", "no scheme://")],
)
def test_it_refuses_a_url_with_another_scheme(
    monkeypatch: pytest.MonkeyPatch, value: str, got: str
) -> None:
    monkeypatch.setenv(VAR, value)

    with pytest.raises(ImproperlyConfigured, match=f"{VAR} must start with") as caught:
        envurl(VAR, ("redis", "rediss"))

    assert f"it has {got}" in str(caught.value)
    assert "redis://, rediss://" in str(caught.value)


def test_it_keeps_a_password_out_of_the_bad_url_message(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A typo in the scheme separator must not print the credentials to the log.
    monkeypatch.setenv(VAR, "postgres:/gpulab:hunter2@db.example/gpulab")

    with pytest.raises(ImproperlyConfigured, match=f"{VAR} must start with") as caught:
        envurl(VAR, ("postgres",))

    assert "hunter2" not in str(caught.value)


def test_it_refuses_a_float_above_the_maximum(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(VAR, "1.5")

    with pytest.raises(ImproperlyConfigured, match=f"{VAR}=1.5 must be at most 1"):
        envfloat(VAR, 0.5, minimum=0, maximum=1)


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("GPULAB_QUOTA_OVERRUN", "kill", "GPULAB_QUOTA_OVERRUN='kill' is not one of"),
        ("GPULAB_QUOTA_SOFT_FACTOR", "2", "GPULAB_QUOTA_SOFT_FACTOR=2.0 must be at"),
        ("GPULAB_QUOTA_SOFT_FACTOR", "x", "GPULAB_QUOTA_SOFT_FACTOR='x' is not a"),
    ],
)
def test_the_quota_settings_refuse_bad_values(name: str, value: str, says: str) -> None:
    """Settings are read at import: a process with a bad value stops with it named."""
    import os
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", "import portal.settings"],
        env={**os.environ, name: value},
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode != 0
    assert says in result.stderr


def test_it_parses_networks(monkeypatch: pytest.MonkeyPatch) -> None:
    from ipaddress import ip_network

    monkeypatch.setenv("NETS", " 10.0.0.0/8, fd00::/8,,192.168.1.7 ")
    assert envnetworks("NETS") == (
        ip_network("10.0.0.0/8"),
        ip_network("fd00::/8"),
        ip_network("192.168.1.7/32"),
    )
    monkeypatch.delenv("NETS")
    assert envnetworks("NETS") == ()


@pytest.mark.parametrize("value", ["10.0.0.0/33", "lab", "10.0.0.0/8;fd00::/8"])
def test_it_refuses_a_bad_network(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("NETS", value)
    with pytest.raises(ImproperlyConfigured, match=r"NETS: .* is not an IP network"):
        envnetworks("NETS")


def test_an_optional_number_is_off_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    assert envfloat_or_none(VAR, minimum=0) is None
    monkeypatch.setenv(VAR, "  ")
    assert envfloat_or_none(VAR, minimum=0) is None
    monkeypatch.setenv(VAR, "0.1")
    assert envfloat_or_none(VAR, minimum=0) == 0.1
    monkeypatch.setenv(VAR, "-1")
    with pytest.raises(ImproperlyConfigured, match=f"{VAR}=-1.0 must be at least 0"):
        envfloat_or_none(VAR, minimum=0)


def test_an_optional_number_on_by_default_is_turned_off_by_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert envfloat_or_none(VAR, default=2.0, minimum=0) == 2.0
    monkeypatch.setenv(VAR, " ")
    assert envfloat_or_none(VAR, default=2.0, minimum=0) == 2.0
    monkeypatch.setenv(VAR, "Off")
    assert envfloat_or_none(VAR, default=2.0, minimum=0) is None
    monkeypatch.setenv(VAR, "2.5")
    assert envfloat_or_none(VAR, default=2.0, minimum=0) == 2.5
    monkeypatch.setenv(VAR, "of")
    with pytest.raises(ImproperlyConfigured, match=f"{VAR}='of' is not a number"):
        envfloat_or_none(VAR, default=2.0, minimum=0)


def test_an_unset_environment_gives_the_policy_defaults() -> None:
    """The portal's settings and ``PolicyConfig`` each carry the policy's defaults
    (the simulator and the benchmarks read the dataclass): with no ``GPULAB_``
    variable set, production's configuration is the dataclass's, field by field."""
    import os
    import subprocess
    import sys

    script = (
        "import dataclasses, json, django\n"
        "django.setup()\n"
        "from scheduler.policy import PolicyConfig\n"
        "from scheduler.services.snapshot import policy_config\n"
        "got, want = policy_config(), PolicyConfig()\n"
        "print(json.dumps({f.name: [getattr(got, f.name), getattr(want, f.name)]\n"
        "    for f in dataclasses.fields(want)\n"
        "    if getattr(got, f.name) != getattr(want, f.name)}, default=str))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULAB_")}
    result = subprocess.run(
        [sys.executable, "-c", script],
        env={**env, "DJANGO_SETTINGS_MODULE": "portal.settings"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "{}"
