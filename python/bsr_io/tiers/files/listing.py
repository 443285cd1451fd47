"""What a store directory holds, by name: the one listing every component goes through.

The tier's scan (index.py), the vLLM worker's inventory and recheck, any catalog an
integration keeps of a rank's records, a striped tier's capacity check and the
quarantine's own list all take their names from here, so they agree with each other and
with the opens (tests/store/test_one_listing.py: no other module lists a store). A load
opens a record with no link in any component below the store (the engine's openat2
RESOLVE_NO_SYMLINKS, or its walk) and only if it is a regular file, so the listing
counts exactly that:

    <chunks dir>/<namespace>/<chunk hash>.chunk
        namespace  a real directory (not a link) whose name matches NS_RE
        record     a regular file (not a link) whose stem matches STEM_RE

Names only: no header is read, so a listing costs one getdents per directory, and the
file type comes with each name on the file systems that report it (one lstat each
elsewhere). A record that lists but fails its header is found by the load that opens
it and quarantined there. The chunks directory itself is the caller's anchor (a store
root or its `chunks/`): it is followed if it is a link.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from bsr_io.tiers.files.records import NS_RE, STEM_RE, SUFFIX, TMP_RE

Held = dict[str, set[int]]  # namespace -> chunk hashes of its records

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

# What a listing does with a temp file it meets (its path).
OnTmp = Callable[[Path], None]


def record_stem(name: str) -> str | None:
    """The chunk hash (hex) a file name stands for, or None if it is no record's name."""
    if not name.endswith(SUFFIX):
        return None
    stem = name[: -len(SUFFIX)]
    return stem if STEM_RE.match(stem) else None


def namespaces(chunks_dir: Path, suffixes: Iterable[str] | None = None) -> list[str]:
    """The namespaces under `chunks_dir` that are real directories (ending in one of
    `suffixes`, e.g. "-w2r1"; all when None). Raises OSError if `chunks_dir` cannot be
    listed (FileNotFoundError when it does not exist)."""
    ends = tuple(suffixes) if suffixes is not None else None
    out = []
    with os.scandir(chunks_dir) as it:
        for e in it:
            if not NS_RE.match(e.name) or (ends is not None and not e.name.endswith(ends)):
                continue
            if e.is_dir(follow_symlinks=False):
                out.append(e.name)
    return sorted(out)


def records(ns_dir: Path, on_tmp: OnTmp | None = None) -> Iterator[tuple[str, Path]]:
    """(stem, path) of each record in the namespace directory `ns_dir`: regular files,
    never links. The directory is opened without following a link, so a link put in
    its place lists nothing. Temp files go to `on_tmp` when given. Yields nothing if
    `ns_dir` is gone or is not a real directory; raises OSError if it cannot be read."""
    for stem, _ in _listed(ns_dir, on_tmp):
        yield stem, ns_dir / f"{stem}{SUFFIX}"


def record_stats(
    ns_dir: Path, on_tmp: OnTmp | None = None, *, sized: bool = False
) -> Iterator[tuple[str, os.stat_result | None]]:
    """(stem, lstat) of each record `records` lists, the lstat taken relative to the open
    directory (one fstatat each) when `sized`, else None: names alone, no path built,
    for the tier's scan of a store of millions. A record removed before its stat is
    left out."""
    for stem, e in _listed(ns_dir, on_tmp):
        if not sized:
            yield stem, None
            continue
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue  # removed meanwhile, or not ours to look at
        if stat.S_ISREG(st.st_mode):  # else replaced by a link (or so) since listed
            yield stem, st


def _listed(ns_dir: Path, on_tmp: OnTmp | None) -> Iterator[tuple[str, os.DirEntry[str]]]:
    try:
        fd = os.open(ns_dir, _DIR_FLAGS)
    except (FileNotFoundError, NotADirectoryError):
        return
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return  # a link where a namespace was: not ours, as the opens would say
        raise
    try:
        with os.scandir(fd) as it:
            for e in it:
                stem = record_stem(e.name)
                if stem is None:
                    if on_tmp is not None and TMP_RE.match(e.name):
                        on_tmp(ns_dir / e.name)
                    continue
                try:
                    regular = e.is_file(follow_symlinks=False)  # d_type, or fstatat
                except OSError:
                    continue  # removed meanwhile
                if regular:
                    yield stem, e
    finally:
        os.close(fd)


def chunk_hashes(ns_dir: Path) -> set[int]:
    """The chunk hashes of the records in one namespace directory (a rank's records of
    one model and layout), by name only: the cheap question a catalog asks again every
    few seconds to stay fresh. Empty if the directory does not exist (yet) or is a link;
    raises OSError if it cannot be read, so a caller keeps the view it had."""
    return {int(stem, 16) for stem, _ in _listed(ns_dir, None)}  # no path built per record


def list_store(chunks_dir: Path, suffixes: Iterable[str] | None = None) -> Held:
    """Every record under `chunks_dir` by namespace (namespaces ending in one of
    `suffixes`; all when None), names only. An absent `chunks_dir` holds nothing; one
    that cannot be read raises OSError."""
    try:
        names = namespaces(chunks_dir, suffixes)
    except FileNotFoundError:
        return {}
    out: Held = {}
    for ns in names:
        hashes = chunk_hashes(chunks_dir / ns)
        if hashes:
            out[ns] = hashes
    return out


def record_stat(chunks_dir: Path, ns: str, chunk_hash: int) -> os.stat_result | None:
    """The lstat of this one record if the store holds it now, by the listing's rules: a
    real namespace directory and a regular file at the record's name (two lstat calls);
    None where it does not (absent, a link, not a directory or not a regular file, no
    record's name). Raises OSError for an errno that leaves it unknown (EIO, EACCES)."""
    if not NS_RE.match(ns) or not 0 <= chunk_hash < 1 << 128:
        return None
    ns_dir = f"{os.fspath(chunks_dir)}/{ns}"  # text, not pathlib: a save asks this each time
    try:
        if not stat.S_ISDIR(os.lstat(ns_dir).st_mode):
            return None  # a link (or a file) where the rank directory was
        st = os.lstat(f"{ns_dir}/{chunk_hash:032x}{SUFFIX}")
    except (FileNotFoundError, NotADirectoryError):
        return None
    return st if stat.S_ISREG(st.st_mode) else None


def holds(chunks_dir: Path, ns: str, chunk_hash: int) -> bool:
    """Whether the store holds this one record now (`record_stat`'s rules); False also
    where an errno leaves it unknown."""
    try:
        return record_stat(chunks_dir, ns, chunk_hash) is not None
    except OSError:
        return False


def held_bytes(chunks_dir: Path) -> int:
    """The bytes of the records under `chunks_dir` (each file's size), by the listing's
    rules: what a tier over it would hold, known before the tier scans it (a capacity
    check at start). An absent `chunks_dir` holds nothing; a record removed meanwhile
    counts nothing; a directory that cannot be read raises OSError."""
    try:
        names = namespaces(chunks_dir)
    except FileNotFoundError:
        return 0
    total = 0
    for ns in names:
        for _, path in records(chunks_dir / ns):
            try:
                total += os.lstat(path).st_size
            except FileNotFoundError:
                pass
    return total


def quarantined(quarantine_dir: Path) -> list[Path]:
    """The records moved aside into `quarantine_dir` (quarantine.py), by name, sorted;
    none where it does not exist or cannot be read."""
    try:
        with os.scandir(quarantine_dir) as it:
            return sorted(Path(e.path) for e in it if e.name.endswith(SUFFIX))
    except OSError:
        return []
