"""The route of a sync: its steps (install a keyframe, apply a delta or a catch-up delta), the
cheapest of the routes the records allow, where its parts are staged and their check before any write,
and installing a keyframe step into a checkpoint."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass

from ..checkpoint.read import INDEX_NAME
from ..format import DeltaReader
from ..io.beside import check_beside, own_dir
from ..storage.base import GET_RANGE, Store
from .baseline import _copy_checkpoint
from .chain import check_links, newest_keyframe
from .history import resets
from .holder import REPAIR_FIX
from .records import CommitRecord, Part, StreamError


@dataclass(frozen=True)
class Step:
    """One step of a sync route: install a keyframe, or apply a delta or a catch-up delta."""

    kind: str  # "keyframe", "delta", "catchup"
    version: int  # the version reached
    parts: list[Part]
    parent: str | None  # fingerprint a delta applies to
    fingerprint: str  # fingerprint reached


def cheapest_route(store: Store, cur: tuple[int, str] | None, recs: dict[int, CommitRecord], *,
                   book_follows: Callable[[], bool] = lambda: True, keeps_book: bool = True,
                   book_writable: bool = True, or_none: bool = False) -> tuple[str, list[Step]] | None:
    """Cheapest in bytes among: the chain of deltas; a keyframe and the deltas after it; a catch-up
    delta (one delta from a keyframe's version, composed by the publisher) and the deltas after it,
    from that keyframe's version or from a keyframe installed first. Parts retention pruned are skipped.

    Only routes the subscriber can decode are taken (``decodable``): ``book_follows()`` says whether
    its history book follows the stream's lineage at ``cur`` (asked only when the chain from ``cur``
    starts with a delta coded with history); ``keeps_book``: whether its applies advance the book (an
    engine's apply hook does not); ``book_writable``: whether the book can be started over and
    advanced at all (``decodable``). ``or_none``: None, instead of the refusal, where routes exist but
    none of them is decodable."""
    versions = sorted(recs)
    last = versions[-1]
    have: dict[str, bool] = {}

    def present(*ps: Part | None) -> bool:  # retention may have pruned parts the records name
        for p in ps:
            if p is None:
                return False
            if p.key not in have:
                have[p.key] = store.exists(p.key)
            if not have[p.key]:
                return False
        return True

    def chain(after: int) -> list[Step] | None:
        steps = [Step("delta", v, [recs[v].delta], recs[v].parent, recs[v].fingerprint)
                 for v in versions if v > after]
        return steps if all(present(*s.parts) for s in steps) else None

    def keyframe(k: int) -> Step | None:
        rec = recs[k]
        parts = [p for _, p in rec.keyframe]
        return Step("keyframe", k, parts, None, rec.fingerprint) if parts and present(*parts) else None

    routes: list[tuple[str, list[Step]]] = []
    if cur is not None and (c := chain(cur[0])) is not None:
        routes.append(("chain", c))
    for k in versions:
        kf, rest = keyframe(k), chain(k)
        if kf is not None and rest is not None:
            routes.append(("keyframe", [kf, *rest]))
    for m in versions:
        rec = recs[m]
        if rec.catchup is None or not present(rec.catchup) or (rest := chain(m)) is None:
            continue
        f = rec.catchup_from
        up = Step("catchup", m, [rec.catchup], None, rec.fingerprint)
        if cur is not None and cur[0] == f:
            routes.append(("catchup", [Step(up.kind, m, up.parts, cur[1], up.fingerprint), *rest]))
        elif f in recs and (kf := keyframe(f)) is not None:
            routes.append(("keyframe+catchup", [kf, Step(up.kind, m, up.parts, kf.fingerprint, up.fingerprint),
                                                *rest]))
    if not routes:
        raise StreamError(f"{store.url}: no route to version {last} from "
                          f"{'version ' + str(cur[0]) if cur else 'nothing'} (no keyframe, or parts pruned)")
    asked: list[bool] = []

    def follows() -> bool:
        if not asked:
            asked.append(book_follows())
        return asked[0]

    usable = [r for r in routes if decodable(r[1], recs, follows, keeps_book, book_writable)]
    if not usable:
        if or_none:
            return None
        raise StreamError(f"{store.url}: no route to version {last} from "
                          f"{'version ' + str(cur[0]) if cur else 'nothing'} that this subscriber can decode: "
                          "the deltas are coded against a history book it does not hold"
                          + ("" if keeps_book else " (an engine's apply hook keeps none)")
                          + ("" if book_writable else " (its history book cannot be written: make its directory "
                                                      "writable, and sync again)"))
    return min(usable, key=lambda r: sum(p.bytes for s in r[1] for p in s.parts))


def decodable(steps: list[Step], recs: dict[int, CommitRecord], book_follows: Callable[[], bool],
              keeps_book: bool = True, book_writable: bool = True) -> bool:
    """Whether a route's deltas coded with history (record ``history``) all meet the book they were
    coded against, and the route leaves a book that follows the stream (so that the next sync can go
    on by the chain). Follows the lineage (``stream.history``): a keyframe install, and a version that
    resets, leave a book that follows; a catch-up step leaves an empty one, which follows only where
    its version resets; a delta coded with history needs a book that follows, and keeps it following
    (where the subscriber keeps a book). ``book_follows()``: whether the book held before the first
    step follows. ``book_writable`` false (a book that cannot be started over nor advanced): the
    book stays what it was at every step, so only the held book, where it follows, decodes the
    route's first delta coded with history and none after it; and such a route is taken even where
    it leaves a book that does not follow (the checkpoint goes forward, and the next sync needs a
    keyframe ahead or a writable book; a route that installs an older keyframe is never decodable,
    so a checkpoint never goes back to one it cannot go forward from)."""
    ok: bool | None = None  # None: the held book, not asked yet
    for s in steps:
        rec = recs[s.version]
        if s.kind == "keyframe":
            ok = book_writable
        elif s.kind == "catchup":
            ok = resets(rec) and book_writable
        else:
            if rec.history:
                if ok is None:
                    ok = book_follows()
                if not ok:
                    return False
                ok = keeps_book and book_writable
            if resets(rec):
                ok = book_writable
    return ok is not False or not book_writable


def _keyframe_temps(checkpoint: str) -> tuple[str, str]:
    """The fixed names ``install_keyframe`` builds beside a checkpoint: the new copy, the replaced one."""
    return f"{checkpoint}.deltarefit-keyframe.tmp", f"{checkpoint}.deltarefit-old"


def check_keyframe_temps(checkpoint: str) -> None:
    """Refuse (``io.beside.check_beside``: one line naming the path) a symbolic link, or what is neither
    a regular file nor a directory of this user's, at the names ``install_keyframe`` builds beside the
    checkpoint: another user's link there is never followed, nor removed."""
    for p in _keyframe_temps(checkpoint):
        check_beside(p, "keyframe temporary", directory=None)


def remove_keyframe_leftovers(checkpoint: str) -> list[str]:
    """Remove what a sync killed inside ``install_keyframe`` left beside the checkpoint: the new copy
    it was building, and the replaced directory once the checkpoint is in place again (while it is
    missing, the old copy stays until the keyframe is installed again). Either can be as large as the
    checkpoint, and the next sync may take a chain route, which never reaches the install. What was
    planted there is refused first (``check_keyframe_temps``). Call under the checkpoint's lock.
    Returns the paths removed."""
    check_keyframe_temps(checkpoint)
    tmp, old = _keyframe_temps(checkpoint)
    gone = []
    for p in (tmp, old) if os.path.exists(checkpoint) else (tmp,):
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p, ignore_errors=True)
        elif os.path.lexists(p):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
        else:
            continue
        gone.append(p)
    return gone


def _new_file_mode(path: str) -> int:
    """The permission bits a checkpoint installed at ``path`` gets: those of the file it replaces, else
    what a new file gets (0666 less the umask, read without changing it)."""
    with contextlib.suppress(OSError):
        return stat.S_IMODE(os.stat(path).st_mode)
    return 0o666 & ~_umask()


def _umask() -> int:
    """The process's umask, read without changing it (0o022 where it cannot be read)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    return 0o022


def install_keyframe(rec: CommitRecord, local: dict[str, str], staging: str, checkpoint: str) -> None:
    """Replace the checkpoint by a keyframe's files, built aside and renamed into place.

    A checkpoint that is (or, when missing, is named as) a ``.safetensors`` file becomes one file;
    a missing directory is made holding the keyframe's files as published; into an existing directory
    only the weight files and their index are installed (``_install_weights_into``: every other entry,
    subdirectory and link, and the directory's mode, stay). The
    temporaries are checked (``check_keyframe_temps``) before each is written: a link another user
    plants there meanwhile is refused, never followed."""
    kdir = own_dir(os.path.join(own_dir(staging, "staging directory"), "keyframe"), "staging directory")
    for name, part in rec.keyframe:
        os.replace(local[part.key], os.path.join(kdir, name))
    # Fixed temp names: a sync killed here leaves them, and the next one replaces them.
    tmp, _ = _keyframe_temps(checkpoint)
    check_keyframe_temps(checkpoint)
    as_dir = os.path.isdir(checkpoint) or (
        not os.path.exists(checkpoint) and not checkpoint.endswith(".safetensors"))
    if not as_dir:
        src = kdir if len(rec.keyframe) > 1 else os.path.join(kdir, rec.keyframe[0][0])
        if os.path.isfile(src):
            # One file, staged beside the checkpoint: renamed in, never copied (a copy needs the
            # checkpoint's size free a second time); copied only across filesystems.
            try:
                os.chmod(src, _new_file_mode(checkpoint))  # the staged part's own mode is 0600
                os.replace(src, checkpoint)
                return
            except OSError as e:
                if e.errno != errno.EXDEV:
                    raise
        _copy_checkpoint(src, tmp)
        os.replace(tmp, checkpoint)
        return
    if os.path.isdir(checkpoint):
        _install_weights_into(kdir, checkpoint)
        return
    shutil.rmtree(tmp, ignore_errors=True)
    os.chmod(kdir, 0o777 & ~_umask())  # a new directory as mkdir would make it (the staging's is 0700)
    os.replace(kdir, tmp)
    os.replace(tmp, checkpoint)


def _weight_entries(directory: str) -> set[str]:
    """The top-level entries of a Hugging Face directory that are its weights: ``*.safetensors`` files (or
    links to them: a hub cache's snapshot) and the index. Nothing else is a keyframe's to replace."""
    out = set()
    for name in os.listdir(directory):
        if name.endswith(".safetensors") or name == INDEX_NAME:
            with contextlib.suppress(FileNotFoundError):
                if not stat.S_ISDIR(os.lstat(os.path.join(directory, name)).st_mode):
                    out.add(name)
    return out


def _install_weights_into(kdir: str, checkpoint: str) -> None:
    """Install a keyframe's files (``kdir``: its weights, and its index where it has one) into the existing
    directory ``checkpoint``: each renamed over its name (a link there is replaced, never followed; the
    mode of the file it replaces kept), the index last, then the old weight files the keyframe does not
    have removed. Nothing else in the directory is touched: subdirectories (a repository's ``original/``),
    links, config and tokenizer files, and the directory's own mode stay as they were. A kill midway
    leaves the directory neither version: its version record then refuses the next sync, and ``sync
    --repair`` installs the keyframe again."""
    from ..io.fsutil import create_temp, fsync_dir

    new = sorted(os.listdir(kdir), key=lambda n: (n == INDEX_NAME, n))
    old = _weight_entries(checkpoint)
    for name in new:
        src, dst = os.path.join(kdir, name), os.path.join(checkpoint, name)
        if os.path.isdir(dst) and not os.path.islink(dst):
            raise StreamError(f"{dst}: a directory where the keyframe installs its weight file {name}; nothing "
                              "was replaced there (move it away and run again)")
        os.chmod(src, _new_file_mode(dst) if not os.path.islink(dst) else 0o666 & ~_umask())
        try:
            os.replace(src, dst)
        except OSError as e:
            if e.errno != errno.EXDEV:
                raise
            tmp = f"{dst}.tmp-{os.getpid()}"
            with open(src, "rb") as f, os.fdopen(create_temp(tmp, stat.S_IMODE(os.stat(src).st_mode)), "wb") as g:
                shutil.copyfileobj(f, g, 16 << 20)  # never through a link planted at the temp name
            os.replace(tmp, dst)
    if INDEX_NAME in old and INDEX_NAME not in new:
        os.unlink(os.path.join(checkpoint, INDEX_NAME))  # first: an index naming files gone would be read
    for name in sorted(old - set(new) - {INDEX_NAME}):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(checkpoint, name))
    fsync_dir(checkpoint)


def staging_for(steps: list[Step], memory: str | None, beside: str) -> str:
    """Where a route's parts are staged: ``memory`` (a subscriber's ``memory_staging``) for a route of
    deltas whose parts take at most a quarter of the room left there (an engine's: no byte of it
    reaches a disk), else ``beside`` the checkpoint (its ``staging``)."""
    if memory is None or any(st.kind == "keyframe" for st in steps):
        return beside
    need = sum(p.bytes for st in steps for p in st.parts)
    try:
        room = shutil.disk_usage(os.path.dirname(memory)).free
    except OSError:
        return beside
    return memory if need <= room // 4 else beside


def overlaps(store: Store, steps: list[Step]) -> bool:
    """Whether a route applied by plain apply (not an engine's hook) is synced with its download and the
    first plan overlapped: deltas only (keyframes are staged whole), from a store with ranged reads."""
    return GET_RANGE in store.capabilities and all(st.kind != "keyframe" for st in steps)


def check_staged(url: str, steps: list[Step], local: dict[str, str]) -> None:
    """Each staged delta (``local``: part key -> staged path) must say what its record says, before any
    write."""
    for st in steps:
        if st.kind != "keyframe":
            with DeltaReader(local[st.parts[0].key]) as d:
                if (d.base_fingerprint, d.target_fingerprint) != (st.parent, st.fingerprint):
                    raise StreamError(f"{url} version {st.version}: its {st.kind} goes from "
                                      f"{d.base_fingerprint[:16]}… to {d.target_fingerprint[:16]}…, the record "
                                      f"says {str(st.parent)[:16]}… to {st.fingerprint[:16]}…")


def choose_route(store: Store, cur: tuple[int, str] | None, recs: dict[int, CommitRecord], target: int, *,
                 load: Callable[[int], CommitRecord], commit: Callable[[int], CommitRecord], keeps_book: bool,
                 writable: bool, book_follows: Callable[[], bool], book_path: str,
                 checkpoint: str) -> tuple[str, list[Step], dict[int, CommitRecord]]:
    """(route, steps, records) of a sync from ``cur`` to ``target``: the cheapest route over ``recs``
    (read and linked from ``cur``; ``book_follows()``: whether the held history book decodes the chain),
    else back from the newest keyframe at or before the held version, whose records (``load``: read,
    ``commit``: read and trusted) join ``recs``. ``writable``: whether the book can be written."""
    best = cheapest_route(store, cur, recs, book_follows=book_follows, keeps_book=keeps_book,
                          book_writable=writable, or_none=cur is not None)
    if best is None:
        # The held book cannot decode the chain and no keyframe lies ahead: go back to the newest
        # keyframe (at or before the held version), which starts the book over. A book that cannot
        # be written would not follow after that keyframe either: the checkpoint stays where it is.
        if not writable:
            raise StreamError(f"{book_path}: history book cannot be written, and version {cur[0] + 1}'s "
                              f"delta is coded against it; {checkpoint} stays at version {cur[0]} (make the "
                              "book's directory writable, and sync again)")
        k = newest_keyframe(load, target)
        if k <= cur[0]:
            recs = {**{v: commit(v) for v in range(k, cur[0] + 1)}, **recs}
            check_links(recs, None, store.url, REPAIR_FIX)
            best = cheapest_route(store, None, recs, keeps_book=keeps_book, book_writable=writable)
        else:
            best = cheapest_route(store, cur, recs, book_follows=lambda: False, keeps_book=keeps_book,
                                  book_writable=writable)
    return best[0], best[1], recs
