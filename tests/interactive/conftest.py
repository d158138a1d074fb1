"""Fixtures of the interactive tests: a non-root account for JupyterLab."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from tests.interactive.accounts import jupyter_account, workdir_for

if TYPE_CHECKING:
    import pwd
    from collections.abc import Iterator
    from pathlib import Path


@pytest.fixture(scope="session")
def account() -> Iterator[pwd.struct_passwd]:
    with jupyter_account() as acct:
        yield acct


@pytest.fixture
def workdir(account: pwd.struct_passwd) -> Iterator[Path]:
    with workdir_for(account) as path:
        yield path
