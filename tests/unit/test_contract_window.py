"""The supported-revision window (docs/contract.md, "Supported revisions"): the
last two revisions, and no revision constant left for a revision every peer in
the window already has, so that a bump that moves the window also drops the code
kept for the revision it leaves behind."""

from __future__ import annotations

import engine_contract

WINDOW = ("CONTRACT_REVISION", "MINIMUM_CLIENT_REVISION", "MINIMUM_SERVER_REVISION")


def test_both_minimums_are_within_the_last_two_revisions() -> None:
    now = engine_contract.CONTRACT_REVISION
    assert now - 1 <= engine_contract.MINIMUM_SERVER_REVISION <= now
    assert now - 1 <= engine_contract.MINIMUM_CLIENT_REVISION <= now


def test_every_feature_revision_is_one_a_supported_server_may_lack() -> None:
    features = {
        name: value
        for name, value in vars(engine_contract).items()
        if name.endswith("_REVISION") and name not in WINDOW
    }
    stale = {
        name: value
        for name, value in features.items()
        if value <= engine_contract.MINIMUM_SERVER_REVISION
    }
    assert not stale, (
        f"{stale}: every server from MINIMUM_SERVER_REVISION "
        f"({engine_contract.MINIMUM_SERVER_REVISION}) on has these; delete each constant "
        "and the code that checks it"
    )
