"""The node-mode rule, one table: the flags each admin verb leaves, and the mode
a node's flags show (the console, the node page, the API and the live state all
read these)."""

from __future__ import annotations

import pytest

from scheduler.models import NODE_MODE_VERBS, Node, mode_flags, node_mode

FLAGS = [(False, False), (True, False), (False, True), (True, True)]

# verb, (draining, maintenance) before -> after
LEAVES = {
    "drain": {
        (False, False): (True, False),
        (True, False): (True, False),
        (False, True): (True, True),
        (True, True): (True, True),
    },
    "maintenance": {
        (False, False): (False, True),
        (True, False): (True, True),
        (False, True): (False, True),
        (True, True): (True, True),
    },
    "resume": dict.fromkeys(FLAGS, (False, False)),
}


@pytest.mark.parametrize("verb", NODE_MODE_VERBS)
@pytest.mark.parametrize(("draining", "maintenance"), FLAGS)
def test_each_verb_leaves_its_flags(
    verb: str, *, draining: bool, maintenance: bool
) -> None:
    expected = LEAVES[verb][draining, maintenance]
    assert mode_flags(verb, draining=draining, maintenance=maintenance) == expected

    node = Node(draining=draining, maintenance=maintenance)
    assert node.apply_mode(verb) is (expected != (draining, maintenance))
    assert (node.draining, node.maintenance) == expected


def test_an_unknown_verb_is_refused_and_changes_nothing() -> None:
    node = Node(draining=True)
    with pytest.raises(ValueError, match="Unknown node mode 'undrain'"):
        node.apply_mode("undrain")
    assert (node.draining, node.maintenance) == (True, False)


@pytest.mark.parametrize(
    ("draining", "maintenance", "shown"),
    [
        (False, False, ""),
        (True, False, "draining"),
        (False, True, "maintenance"),
        (True, True, "maintenance"),  # it says why the node is out
    ],
)
def test_the_mode_a_node_shows(
    *, draining: bool, maintenance: bool, shown: str
) -> None:
    assert node_mode(draining=draining, maintenance=maintenance) == shown
    assert Node(draining=draining, maintenance=maintenance).mode == shown
