"""The provider's claims as a DirectoryIdentity: what each configured claim gives,
and every missing or mistyped claim refused with its name."""

from __future__ import annotations

from typing import Any

import pytest

from portal.oidc.claims import ClaimError, ClaimNames, identity_from_claims

NAMES = ClaimNames(
    username="preferred_username",
    groups="groups",
    unix_name="unix_name",
    uid="uid",
    gid="gid",
    gids="gids",
    active="active",
)
GOOD: dict[str, Any] = {
    "sub": "8d1f",
    "preferred_username": "ada",
    "email": "ada@lab.example.org",
    "given_name": "Ada",
    "family_name": "Lovelace",
    "groups": ["vision-lab", "/lab/nlp"],
    "unix_name": "ada",
    "uid": 20001,
    "gid": "20001",
    "gids": ["3000", 3001],
    "active": True,
}


def test_every_claim_is_read() -> None:
    identity = identity_from_claims(GOOD, NAMES)
    assert identity.username == "ada"
    assert identity.source == "oidc"
    assert (identity.email, identity.first_name, identity.last_name) == (
        "ada@lab.example.org",
        "Ada",
        "Lovelace",
    )
    assert identity.groups == frozenset({"vision-lab", "/lab/nlp"})
    assert (identity.unix_name, identity.uid, identity.gid) == ("ada", 20001, 20001)
    assert identity.gids == (3000, 3001)
    assert identity.active is True


def test_unnamed_claims_are_not_read() -> None:
    identity = identity_from_claims(
        {"preferred_username": "ada", "groups": []}, ClaimNames()
    )
    assert (identity.uid, identity.gid, identity.gids, identity.unix_name) == (
        None,
        None,
        (),
        "",
    )
    assert identity.active is True
    # Groups not read at all ("-"): no claim needed.
    assert (
        identity_from_claims(
            {"preferred_username": "ada"}, ClaimNames(groups="-")
        ).groups
        == frozenset()
    )


def test_a_comma_separated_gids_string_and_a_false_active_string() -> None:
    identity = identity_from_claims(
        {**GOOD, "gids": "3000, 3001", "active": "false"}, NAMES
    )
    assert identity.gids == (3000, 3001)
    assert identity.active is False


@pytest.mark.parametrize(
    ("change", "claim", "says"),
    [
        ({"preferred_username": None}, "preferred_username", "is missing"),
        ({"preferred_username": 7}, "preferred_username", "should be a string"),
        ({"preferred_username": "a b"}, "preferred_username", "not a user name"),
        ({"groups": None}, "groups", "is missing"),
        ({"groups": [1, 2]}, "groups", "should be a list of group names"),
        ({"groups": {"a": 1}}, "groups", "should be a list of group names, not an"),
        ({"unix_name": "Ada Lovelace"}, "unix_name", "not a Unix account name"),
        ({"unix_name": None}, "unix_name", "is missing"),
        ({"uid": None}, "uid", "is missing"),
        ({"uid": "twenty"}, "uid", "is 'twenty', not a number"),
        ({"uid": True}, "uid", "should be a number, not a boolean"),
        ({"uid": 1.5}, "uid", "should be a number, not a number (1.5)"),
        ({"uid": 0}, "uid", "is 0 (root)"),
        ({"uid": -5}, "uid", "is -5, outside"),
        ({"gid": 2**32}, "gid", "outside 0..4294967294"),
        ({"gids": [3000, "x"]}, "gids", "is 'x', not a number"),
        ({"gids": {"a": 1}}, "gids", "should be a list of numbers"),
        ({"active": None}, "active", "is missing"),
        ({"active": "yes"}, "active", "should be true or false"),
    ],
)
def test_a_missing_or_mistyped_claim_is_refused_by_name(
    change: dict[str, Any], claim: str, says: str
) -> None:
    claims = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    with pytest.raises(ClaimError) as caught:
        identity_from_claims(claims, NAMES)
    assert caught.value.claim == claim
    assert f"claim {claim!r}" in str(caught.value)
    assert says in str(caught.value)


def test_missing_groups_claim_says_how_to_fix_it() -> None:
    claims = {k: v for k, v in GOOD.items() if k != "groups"}
    with pytest.raises(ClaimError, match="GPULAB_OIDC_GROUPS_CLAIM"):
        identity_from_claims(claims, NAMES)
