"""Pure decisions of a relay: where a joining node goes in the tree, and where its stream starts.

No I/O here: ``node.py`` gathers the facts (its children, its path from the root, the versions it
knows) and calls these functions, so the policies are testable with plain tables.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

WAIT = -1  # start_version: nothing to serve yet; ask again when a version arrives


@dataclass(frozen=True)
class Child:
    id: str
    addr: str  # where the child listens (redirect target)
    size: int = 1  # nodes in its subtree, itself included, as it last reported
    hosts_new: bool = True  # its subtree can start a node holding nothing (it holds a keyframe version)


@dataclass(frozen=True)
class Placement:
    kind: str  # "accept", "redirect" or "refuse"
    to: str = ""  # the redirect target's address
    why: str = ""


def place(joiner: str, me: str, path: Sequence[str], children: Sequence[Child], fanout: int, *,
          new: bool = False, avoid: Collection[str] = ()) -> Placement:
    """Where ``joiner`` attaches when it says HELLO to node ``me`` (whose ancestors are ``path``, root
    first) holding ``children``.

    * A joiner that is ``me`` or one of my ancestors would close a cycle: refuse.
    * A joiner already among my children is the same node reconnecting (it restarted, or lost the
      connection before I noticed): accept, replacing the stale entry.
    * Free capacity (fewer than ``fanout`` children): accept.
    * Otherwise redirect into the child subtree with the fewest nodes (the first of equals), which
      keeps the tree balanced and its depth near log_fanout(nodes). A ``new`` joiner (holding nothing)
      only goes to subtrees that can start it from a keyframe; with none, it is refused.
    * Children whose address the joiner ``avoid``s (they sent it bad parts) are no redirect target; a
      joiner that would have gone to one and has no other subtree to go to is accepted here, over the
      fan-out (it routes around a bad relay; the tree rebalances as nodes rejoin).
    """
    if joiner == me or joiner in path:
        return Placement("refuse", why=f"{joiner} is this relay or one of its ancestors (a cycle)")
    if any(c.id == joiner for c in children):
        return Placement("accept", why="reconnect")
    if len(children) < fanout:
        return Placement("accept")
    fit = [c for c in children if c.hosts_new or not new]
    if not fit:
        return Placement("refuse", why="no capacity here and no subtree can start a new node")
    fit = [c for c in fit if c.addr not in avoid]
    if not fit:
        return Placement("accept", why="routing around an avoided relay")
    best = min(fit, key=lambda c: c.size)
    return Placement("redirect", to=best.addr)


def subtree_size(children: Sequence[Child]) -> int:
    return 1 + sum(c.size for c in children)


def start_version(held: int, known: Mapping[int, bool]) -> int:
    """The first version to push to a child holding version ``held`` (0: nothing), given the versions
    this node knows, each with whether it holds that version's keyframe files (``known``).

    * A child holding something continues its chain at ``held + 1``, now or once it arrives, unless
      this node's versions begin after that (it can't serve the chain): then as a new child.
    * A child holding nothing starts at the newest version this node has as a keyframe.
    * Nothing to offer yet (an empty stream): ``WAIT``. A node with versions but no keyframe can't
      serve a new child: -2 (the caller refuses it).
    """
    if held > 0 and (not known or held + 1 >= min(known)):
        return held + 1
    kfs = [v for v, kf in known.items() if kf]
    if kfs:
        return max(kfs)
    return WAIT if not known else -2


def parts_to_send(held_keys: Sequence[str], delta: str | None, keyframe: Sequence[str], *,
                  as_keyframe: bool) -> list[str]:
    """Which of the parts this relay holds for a version (``held_keys``) go to a child: the keyframe's
    files when the child starts there holding nothing (``as_keyframe``), else the delta when held here,
    else whatever is held (a keyframe version reached without its delta)."""
    if as_keyframe:
        return list(keyframe)
    if delta is not None and delta in held_keys:
        return [delta]
    return list(held_keys)


def root_parts(delta: str | None, keyframe: Sequence[str]) -> list[str]:
    """The parts the root mirrors for a version: the delta and, on keyframe versions, the keyframe's
    files too (children continuing a chain get the delta, new nodes starting there the files)."""
    return ([delta] if delta is not None else []) + list(keyframe)


def parse_addrs(text: str) -> list[str]:
    """``HOST:PORT[,HOST:PORT...]`` to a list, blanks dropped."""
    return [a.strip() for a in text.split(",") if a.strip()]
