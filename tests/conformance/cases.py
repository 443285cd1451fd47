"""The hostile cases every integration must pass, one definition for all (issue 48 item 5).

Each host (the core `Restorer`, vLLM's scheduler and worker pair, SGLang's HiCache
backend, LMCache's plugin) has an adapter with the `Host` interface below, which drives
the host's own interface and reports what the host would see: how many leading chunks
its discovery offers, how many a load hands it as restored and whether their bytes are
the saved ones, whether a save told it of a failure. A case is a function of a factory
of such hosts and a scratch directory; it asserts only through that interface, so one
case means the same thing for every host.

`TABLE` names, for every case and every host, either that it applies or why it does not
(`NA`): a test file runs the cases that apply and `check_table` fails on a case a host
neither runs nor explains. No vLLM or SGLang import here: this module is imported in
every venv.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, Protocol, TypeVar

import pytest

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))
from fuse_stall import late_file  # noqa: E402

CHUNKS = 4  # chunks per prefix in every case
STALLED = 1  # the chunk whose read the kernel holds
A, B = 1, 2  # prefixes, by seed: each host derives its tokens and bytes from the seed
HOSTS = ("core", "lmcache", "vllm", "sglang")
D = TypeVar("D")  # a host's destination for a load


@dataclass
class Saved:
    """What the host was told of a save: `ok` (every chunk stored, as the host sees it),
    `paths` (chunk i's record file on the first file tier), `error` (what it was told),
    `cause` (the error itself, kept as a caller that reports it later keeps it: a slot
    its frames pinned would stay out of the ring while it is kept)."""

    ok: bool
    paths: list[Path]
    error: str = ""
    cause: BaseException | None = None


@dataclass
class Loaded:
    """What a load handed the host: `verified` leading chunks it takes as restored,
    `right` whether their bytes are the saved ones, `reason` what it was told."""

    verified: int
    right: bool
    reason: str = ""


class Pending(Protocol):
    """A load running on a thread of its own (the stall case)."""

    def wait(self, timeout_s: float) -> bool: ...

    @property
    def result(self) -> Loaded: ...


class Host(Protocol):
    window: int

    def save(self, seed: int) -> Saved: ...
    def offered(self, seed: int) -> int: ...
    def load(self, seed: int) -> Loaded: ...
    def start_load(self, seed: int) -> Pending: ...
    def unhealthy(self) -> bool: ...
    def reuse(self, pending: Pending, seed: int) -> bool: ...
    def holds(self, pending: Pending, seed: int) -> bool: ...
    def relist(self, during: Callable[[], object]) -> None: ...
    def free_slots(self) -> int: ...
    def broken_lease(self) -> AbstractContextManager[None]: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class Options:
    """What a case asks of a host beyond its store: `lower` (a lower tier's directory),
    a load deadline of `timeout_s`, re-listing every `rescan_s`; `role`: "" (reads and
    writes), "writer" or "reader" (a rank that does not write, started before the writer)."""

    lower: Path | None = None
    timeout_s: float = 10.0
    rescan_s: float = 60.0
    role: str = ""


Make = Callable[[Path, Options], Host]  # a host over a store: every adapter's `make`


class Background(Generic[D]):
    """A load on a thread of its own (`Pending`): `load(seed, dest)` into `dest`, the
    host's destination for it (its cache, blocks or pages), kept for `Host.reuse`."""

    def __init__(self, load: Callable[[int, D], Loaded], seed: int, dest: D) -> None:
        self.dest = dest
        self._result: Loaded | None = None
        self._thread = threading.Thread(target=self._run, args=(load, seed), daemon=True)
        self._thread.start()

    def _run(self, load: Callable[[int, D], Loaded], seed: int) -> None:
        self._result = load(seed, self.dest)

    def wait(self, timeout_s: float) -> bool:
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    @property
    def ok(self) -> int:
        """Chunks the load verified; 0 while it runs."""
        return self._result.verified if self._result is not None else 0

    @property
    def result(self) -> Loaded:
        assert self._result is not None
        return self._result


@contextmanager
def failing_lease(*modules: object) -> Iterator[None]:
    """Every `lease` in `modules` raises as a failing engine would (a fault double)."""

    def broken(engine: object, deadline: float) -> object:
        raise OSError(5, "fault double: the engine failed the lease")

    with pytest.MonkeyPatch.context() as mp:
        for m in modules:
            mp.setattr(m, "lease", broken)
        yield


@dataclass(frozen=True)
class NA:
    why: str


@dataclass(frozen=True)
class Case:
    name: str
    run: Callable[[Make, Path], None]
    hosts: dict[str, NA | None] = field(default_factory=dict)  # None: applies
    child: bool = False  # run in a process of its own (see `run_case`)


@contextmanager
def hosted(make: Make, store: Path, opts: Options = Options()) -> Iterator[Host]:
    h = make(store, opts)
    try:
        yield h
    finally:
        h.close()


def _intact(h: Host, seed: int) -> None:
    got = h.load(seed)
    assert (got.verified, got.right) == (CHUNKS, True), got


# -- the cases --------------------------------------------------------------------------
def stalled_read(make: Make, tmp: Path) -> None:
    """A record's payload read held by the kernel (FUSE) past the load's deadline; the
    host then reuses the load's pages for another prefix. The stalled chunk is never
    taken as restored; a host that hands pages back before the kernel returns them
    says it is unhealthy meanwhile (or never gets them back: it holds them); pages the
    host reused keep what it wrote when the late read lands; and the prefix itself
    restores exactly once the kernel answers."""
    store = tmp / "store"
    with hosted(make, store, Options(timeout_s=1.0)) as h:
        a = h.save(A)
        assert a.ok and h.save(B).ok, a
        with late_file(a.paths[STALLED], delay_s=120.0) as stall:
            pending = h.start_load(A)
            if not pending.wait(6.0):
                # Holding the pages while the kernel may write them: not a hit meanwhile.
                assert h.unhealthy(), "holds the load past its deadline but says healthy"
                assert h.offered(B) == 0, "offers a hit while holding pages for the kernel"
                stall.release()
                assert pending.wait(60.0), "still holds the pages after the kernel answered"
            got = pending.result
            assert got.verified <= STALLED and got.right, got
            wrote = h.reuse(pending, B)
            stall.release()
            from bsr_io.load import memory

            assert memory.wait_returned(None, 60.0), "the kernel kept the pages"
        if wrote:
            assert h.holds(pending, B), "the late read landed in pages the host reused"
        h.relist(lambda: None)  # a page only slow may have been dropped until a listing
        _intact(h, A)
        _intact(h, B)
        assert h.free_slots() == h.window


def _linked_record(paths: list[Path]) -> Path:
    """Chunk 0's record moved out of the store and a link left in its place."""
    real = paths[0].parent.parent.parent / "elsewhere" / paths[0].name
    real.parent.mkdir(exist_ok=True)
    paths[0].rename(real)
    paths[0].symlink_to(real)
    return real


def _linked_dir(paths: list[Path]) -> Path:
    """The prefix's rank directory moved aside and a link to it left under its name."""
    ns = paths[0].parent
    real = ns.parent.parent / "elsewhere-ns"
    ns.rename(real)
    ns.symlink_to(real, target_is_directory=True)
    return real


def _never_through_a_link(make: Make, tmp: Path, link: Callable[[list[Path]], Path]) -> None:
    store = tmp / "store"
    with hosted(make, store) as writer:
        saved = writer.save(A)
        assert saved.ok, saved
    real = link(saved.paths)
    with hosted(make, store) as h:
        assert h.offered(A) == 0, "a record reached through a link is offered"
        got = h.load(A)
        assert got.verified == 0 and got.right, got
        h.relist(lambda: None)
        assert h.offered(A) == 0, "offered again after a load met the link"
        assert real.exists(), "the real file behind the link was withdrawn through it"
        assert h.free_slots() == h.window


def linked_record(make: Make, tmp: Path) -> None:
    """A link in place of a record: never listed, never loaded."""
    _never_through_a_link(make, tmp, _linked_record)


def linked_rank_dir(make: Make, tmp: Path) -> None:
    """A link in place of the rank's directory: never listed, never loaded."""
    _never_through_a_link(make, tmp, _linked_dir)


def _bad_record(make: Make, tmp: Path, spoil: Callable[[Path], None]) -> None:
    store = tmp / "store"
    with hosted(make, store) as h:
        saved = h.save(A)
        assert saved.ok, saved
        spoil(saved.paths[STALLED])
        got = h.load(A)
        assert got.verified <= STALLED and got.right, got  # never committed past it
        assert h.offered(A) <= STALLED, "the bad record is offered again"
        assert h.free_slots() == h.window
    with hosted(make, store) as again:  # a new start does not offer it either
        assert again.offered(A) <= STALLED


def wrong_length_record(make: Make, tmp: Path) -> None:
    """A record longer than its header says (a page appended): detected, not committed."""

    def longer(p: Path) -> None:
        with open(p, "ab") as f:
            f.write(b"\x5a" * 4096)

    _bad_record(make, tmp, longer)


def truncated_record(make: Make, tmp: Path) -> None:
    """A record cut short after it was listed: detected, never committed."""

    def shorter(p: Path) -> None:
        from bsr_io.model.record import HEADER_BYTES

        os.truncate(p, HEADER_BYTES + 100)

    _bad_record(make, tmp, shorter)


def truncated_record_l3(make: Make, tmp: Path) -> None:
    """Every record of a prefix cut short after the probe offered it, each with a good
    copy in the lower tier: the load completes from there, exactly, with every slot
    back. A failed read must give its slot back before its chunk's fallback read asks
    for one: with as many short records as the window has slots, a host that keeps them
    waits for a slot until its deadline (the issue: ended `zero`, "none of the engine's
    staging slots came free in time").

    The cut is a real short read from the kernel: each record served through FUSE
    (`late_file`) with its whole size in its metadata and no payload bytes past 100, so
    the tier's open and fstat pass and only the payload read comes back short, as when
    the file is truncated between a reader's fstat and its read. The lower tier's copy
    is the host's write-through where it has one, else the record copied there (as
    another node or an operator fills a shared L3). Twice: the prefix restores again
    once the first load has withdrawn the short records."""
    from bsr_io.model.record import HEADER_BYTES

    lower = tmp / "lower"
    lower.mkdir()
    with hosted(make, tmp / "store", Options(lower=lower)) as h:
        assert h.window <= CHUNKS, "fewer short records than slots: a kept slot may not show"
        saved = h.save(A)
        assert saved.ok, saved
        for p in saved.paths:  # a host whose saves do not write through: copied there
            copy = lower / p.relative_to(tmp / "store")
            if not copy.exists():
                copy.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(p, copy)
        assert h.offered(A) == CHUNKS
        with ExitStack() as short:
            for p in saved.paths:
                short.enter_context(late_file(p, 0.0, short_at=HEADER_BYTES + 100))
            for _ in range(2):
                _intact(h, A)
                assert h.free_slots() == h.window


def save_racing_listing(make: Make, tmp: Path) -> None:
    """A save lands while the host re-lists the store (after the listing read the
    directory, before it ended): the saved prefix is never reported removed."""
    store = tmp / "store"
    with hosted(make, store) as h:
        assert h.save(A).ok
        saved: list[Saved] = []
        h.relist(lambda: saved.append(h.save(B)))
        assert saved and saved[0].ok, saved
        assert h.offered(B) == CHUNKS, "a save landing during a listing was reported removed"
        h.relist(lambda: None)  # the next listing sees the files themselves
        assert h.offered(B) == CHUNKS
        _intact(h, B)


def non_writer_rank(make: Make, tmp: Path) -> None:
    """A rank that does not write, started before the writer stored anything, sees the
    records written after its start within a bounded staleness, and loads them."""
    store = tmp / "store"
    with hosted(make, store, Options(rescan_s=0.2, role="reader")) as reader:
        assert reader.offered(A) == 0
        with hosted(make, store, Options(rescan_s=0.2, role="writer")) as writer:
            assert writer.save(A).ok
        deadline = time.monotonic() + 10
        while reader.offered(A) < CHUNKS:
            assert time.monotonic() < deadline, "the reader never saw the writer's records"
            time.sleep(0.1)
        _intact(reader, A)


def openat2_eperm(make: Make, tmp: Path) -> None:
    """Run in a child under a seccomp filter that answers openat2 with EPERM (`child.py`
    installs it and checks it refuses): a save and a load complete by the walk."""
    with hosted(make, tmp / "store") as h:
        assert h.save(A).ok
        _intact(h, A)
        from bsr_io import Engine

        with Engine(1, 4096) as e:
            assert e.features["open_path"] == "walk", e.features


@contextmanager
def tiny_fs(at: Path, size: str = "16k") -> Iterator[Path]:
    """A real tmpfs of `size` at `at`: writes past it fail ENOSPC in the kernel. Needs
    root (CAP_SYS_ADMIN), as CI has; anywhere else the mount fails the test."""
    at.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(at)], check=True)
    try:
        yield at
    finally:
        subprocess.run(["umount", "-l", str(at)], check=False)


def enospc_l2(make: Make, tmp: Path) -> None:
    """The SSD tier's drive is full: the host is told the save failed, every slot comes
    back, and nothing unverified is served; the host goes on serving another store."""
    with tiny_fs(tmp / "tiny") as full, hosted(make, full) as h:
        saved = h.save(A)
        assert not saved.ok, "a save into a full drive reported stored"
        assert h.free_slots() == h.window
        got = h.load(A)
        assert got.right and (got.verified in (0, CHUNKS) or h.offered(A) >= got.verified), got
    with hosted(make, tmp / "good") as h:
        assert h.save(A).ok
        _intact(h, A)


def enospc_l3(make: Make, tmp: Path) -> None:
    """The lower tier's drive is full: the write-through fails; the host is told (or
    every chunk restores), no slot is lost while the host keeps the error it was given
    (`Saved.cause`), and a load serves only verified bytes."""
    with tiny_fs(tmp / "tiny") as full, hosted(make, tmp / "store", Options(lower=full)) as h:
        saved = h.save(A)
        assert h.free_slots() == h.window
        if saved.ok:
            _intact(h, A)
        else:
            got = h.load(A)  # what the SSD tier took, verified; nothing else
            assert got.right, got
        assert h.free_slots() == h.window


def lease_raises(make: Make, tmp: Path) -> None:
    """The save engine's lease raises (not EngineBusy: a broken engine; a fault double):
    the save ends failed and counted, never stored-with-nothing-written; nothing is
    offered; no slot is lost; the next save succeeds."""
    with hosted(make, tmp / "store") as h:
        with h.broken_lease():
            saved = h.save(A)
        assert not saved.ok, "a save whose lease raised reported stored"
        assert h.offered(A) == 0
        assert h.free_slots() == h.window
        assert h.save(A).ok
        _intact(h, A)


def hash_seeds(make: Make, tmp: Path) -> None:
    """One round of the hash-seed case: `run_case` runs it in three processes, the
    test's own (a random seed) and two under PYTHONHASHSEED 1 and 2 (a scheduler and
    its workers are processes with seeds of their own). The first saves; the others
    must find and restore every chunk under the model identity they derive (a set in
    the host's model config)."""
    marker = tmp / "saved-by-the-first-seed"
    with hosted(make, tmp / "store") as h:
        if not marker.exists():
            assert h.save(A).ok
            marker.write_text(os.environ.get("PYTHONHASHSEED", ""))
            return
        assert h.offered(A) == CHUNKS, "another hash seed, another model identity"
        _intact(h, A)


_CORE_NO_SEEDS = NA("the caller names the model identity as a string (Restorer(model=...))")
_NO_RELIST = NA(
    "keeps no listing of its own: the tier's index is updated by its own saves and a "
    "probe asks the file system (contains), so there is nothing a save could race"
)

CASES: list[Case] = [
    Case("stalled_read", stalled_read, {h: None for h in HOSTS}),
    Case("linked_record", linked_record, {h: None for h in HOSTS}),
    Case("linked_rank_dir", linked_rank_dir, {h: None for h in HOSTS}),
    Case("wrong_length_record", wrong_length_record, {h: None for h in HOSTS}),
    Case("truncated_record", truncated_record, {h: None for h in HOSTS}),
    Case(
        "truncated_record_l3",
        truncated_record_l3,
        {
            "core": None,
            "vllm": None,
            "sglang": None,
            "lmcache": NA("the plugin has no lower file tier (only the SSD tier and a pool)"),
        },
    ),
    Case(
        "save_racing_listing",
        save_racing_listing,
        {"core": _NO_RELIST, "lmcache": _NO_RELIST, "vllm": None, "sglang": None},
    ),
    Case("non_writer_rank", non_writer_rank, {h: None for h in HOSTS}),
    Case(
        "hash_seeds",
        hash_seeds,
        child=True,
        hosts={
            "core": _CORE_NO_SEEDS,
            "lmcache": NA("LMCache's key carries the model name as a string it hashes itself"),
            "sglang": NA("SGLang hands the backend model_name, a string"),
            "vllm": None,
        },
    ),
    Case("openat2_eperm", openat2_eperm, {h: None for h in HOSTS}, child=True),
    Case("enospc_l2", enospc_l2, {h: None for h in HOSTS}),
    Case(
        "enospc_l3",
        enospc_l3,
        {
            "core": None,
            "vllm": None,
            "sglang": None,
            "lmcache": NA("the plugin has no lower file tier (only the SSD tier and a pool)"),
        },
    ),
    Case("lease_raises", lease_raises, {h: None for h in HOSTS}),
]
BY_NAME = {c.name: c for c in CASES}


def applying(host: str) -> list[Case]:
    return [c for c in CASES if c.hosts.get(host, NA("")) is None]


def check_table(host: str) -> None:
    """Every case names `host`: applies, or NA with a reason."""
    for c in CASES:
        assert host in c.hosts, f"case {c.name} says nothing of {host}"
        v = c.hosts[host]
        assert v is None or v.why.strip(), f"case {c.name}: NA for {host} without a reason"


def run_case(
    case: Case,
    make: Make,
    tmp: Path,
    child_args: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> None:
    """Run `case` here, or, for a `child` case, in a process of its own (`child.py`
    with `child_args`: the adapter's module directory, module and factory names)."""
    if not case.child:
        case.run(make, tmp)
        return
    assert child_args is not None, f"{case.name} runs in a child: pass child_args"
    if case.run is hash_seeds:
        # The first round here, under this process's own (random) seed; then two more.
        case.run(make, tmp)
        for seed in ("1", "2"):
            run_child(case.name, tmp, child_args, env={**(env or {}), "PYTHONHASHSEED": seed})
        return
    run_child(case.name, tmp, child_args, seccomp=case.name == "openat2_eperm", env=env)


def run_child(name: str, tmp: Path, child_args: list[str], *, seccomp: bool = False,
              env: dict[str, str] | None = None) -> None:  # fmt: skip
    args = [sys.executable, str(Path(__file__).with_name("child.py")), name, str(tmp)]
    args += ["--seccomp" if seccomp else "--plain", *child_args]
    run = subprocess.run(
        args,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONFAULTHANDLER": "1", **(env or {})},
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
