"""The subscriber's holder seam (``stream.holder``) and its plan-only sync (``Subscriber.plan``), the path
the vLLM backend's prepare takes: real checkpoints of a tiny BERT, a real store on disk. A holder that
plans ahead is a checkpoint holder whose plan is the real read-only check of the staged delta against
the checkpoint (``apply.files.check``)."""

from __future__ import annotations

import os

import pytest
from _stream_util import chain_fingerprints, read_bytes, session_chain, sha

import deltarefit
from deltarefit.apply.files import check as check_delta
from deltarefit.format import DeltaReader
from deltarefit.storage import LocalStore
from deltarefit.stream import Publisher, Subscriber
from deltarefit.stream.holder import CheckpointHolder
from deltarefit.stream.outcomes import Planned, SyncReport
from deltarefit.stream.subscriber import state_path


@pytest.fixture(scope="session")
def chain(tmp_path_factory) -> list[str]:
    return session_chain(tmp_path_factory)


@pytest.fixture(scope="session")
def chain_fps(chain) -> list[str]:
    return chain_fingerprints(chain)


@pytest.fixture
def store(tmp_path, chain) -> LocalStore:
    """Versions 1 (a keyframe), 2 and 3 (deltas) of the chain."""
    st = LocalStore(str(tmp_path / "store"))
    pub = Publisher(st, str(tmp_path / "pub"))
    for v in (1, 2, 3):
        pub.publish(chain[v], step=v)
    return st


class PlanningHolder(CheckpointHolder):
    """A checkpoint that plans ahead: ``plan`` checks the staged delta against the checkpoint (read only)
    and keeps (base, target) fingerprints of each delta it was handed."""

    plans = True

    def __init__(self, checkpoint: str) -> None:
        super().__init__(checkpoint)
        self.planned: list[tuple[str, str]] = []

    def plan(self, delta_path, book) -> None:
        check_delta(delta_path, self.checkpoint, history=book)
        with DeltaReader(delta_path) as d:
            self.planned.append((d.base_fingerprint, d.target_fingerprint))


def test_plan_stages_the_route_writes_nothing_and_the_sync_after_it_applies_it(store, tmp_path, chain_fps):
    ck = str(tmp_path / "roll.safetensors")
    sub = Subscriber(store, ck, subscriber_id="roll")
    sub.sync(to_version=1)
    before, state = sha(ck), read_bytes(state_path(ck))
    assert sub.plan() == Planned(1, 3, "chain")
    assert sha(ck) == before and read_bytes(state_path(ck)) == state and sub.current() == (1, chain_fps[1])
    assert len(os.listdir(sub.staging)) == 2  # both deltas staged, and kept for the sync that writes them
    rep = sub.sync()
    assert (rep.from_version, rep.version, rep.versions_applied) == (1, 3, [2, 3])
    assert deltarefit.fingerprint(ck) == chain_fps[3] and not os.path.exists(sub.staging)


def test_a_holder_that_plans_is_handed_the_routes_first_delta_only(store, tmp_path, chain_fps):
    ck = str(tmp_path / "roll.safetensors")
    holder = PlanningHolder(ck)
    sub = Subscriber(store, ck, subscriber_id="roll", holder=holder)
    sub.sync(to_version=1)
    before = sha(ck)
    assert sub.plan(to_version=3) == Planned(1, 3, "chain")
    assert holder.planned == [(chain_fps[1], chain_fps[2])] and sha(ck) == before
    assert sub.sync().version == 3 and deltarefit.fingerprint(ck) == chain_fps[3]
    at_head = sub.plan()  # at the head: checked as a sync checks it, nothing planned
    assert isinstance(at_head, SyncReport) and (at_head.route, at_head.version) == ("none", 3)
    assert holder.planned == [(chain_fps[1], chain_fps[2])]


def test_a_plan_whose_route_starts_with_a_keyframe_plans_nothing_and_installs_nothing(store, tmp_path, chain_fps):
    ck = str(tmp_path / "new.safetensors")
    holder = PlanningHolder(ck)
    sub = Subscriber(store, ck, subscriber_id="new", holder=holder)
    assert sub.plan() == Planned(0, 3, "keyframe")
    assert holder.planned == [] and not os.path.exists(ck) and sub.current() is None
    rep = sub.sync()
    assert (rep.route, rep.version) == ("keyframe", 3) and deltarefit.fingerprint(ck) == chain_fps[3]
