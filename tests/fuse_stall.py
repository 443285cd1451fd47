"""A real kernel stall: one file served through FUSE whose payload reads are answered late.

`late_file(path, delay_s)` mounts a one-file FUSE file system over `path` (a regular file:
the mount's root is that file), served by a process of its own that answers every READ at
or past `from_offset` only after `delay_s` seconds, with the file's real bytes (with
`short_at`, none past that offset: a file cut short after its size was read, as a
truncation between a reader's fstat and its read leaves it). A reader's
request (an O_DIRECT read through io_uring or pread) is held in the kernel meanwhile: it
cannot be withdrawn, and its memory is written when the answer comes. Opens reply
FOPEN_DIRECT_IO, so the page cache never answers for the server.

`late_dir(path, delay_s, ops, suffix)` serves a whole directory (a save's temp file has a
fresh name, so no one-file mount can stand where it will be) and answers the chosen calls
(lookup, open, read, write, fsync, getattr) on the files whose name ends with `suffix` late:
all of them, or (`every`, `per_file`) the first of each `every`-th such file, one stall per
record written, as `bsr-lab bench serve --write-stall` uses it; each held call is logged.

The server speaks the kernel's FUSE protocol itself (<linux/fuse.h>, protocol 7.31 replies):
no libfuse, no Python package. It needs root and /dev/fuse. `release()` answers held reads
at once; leaving the block unmounts (`umount -l`) and waits for the server.

    python fuse_stall.py SOURCE MOUNTPOINT DELAY_S FROM_OFFSET READY_FILE [SHORT_AT]
    python fuse_stall.py --dir DIRECTORY DELAY_S OPS SUFFIX READY_FILE [EVERY PER_FILE LOG]
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

IN_HEADER = struct.Struct("<IIQQIIIHH")  # len, opcode, unique, nodeid, uid, gid, pid, ext, pad
OUT_HEADER = struct.Struct("<IiQ")  # len, error, unique
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")  # fuse_attr (88 bytes)
LOOKUP, FORGET, GETATTR, OPEN, READ, STATFS, RELEASE, FLUSH = 1, 2, 3, 14, 15, 17, 18, 25
INIT, INTERRUPT, DESTROY, BATCH_FORGET = 26, 36, 38, 42
NO_REPLY = (FORGET, INTERRUPT, BATCH_FORGET)
FOPEN_DIRECT_IO = 1
S_IFREG = 0o100000


class _Server:
    def __init__(
        self, source: str, delay_s: float, from_offset: int, short_at: int | None = None
    ) -> None:
        with open(source, "rb") as f:
            self.data = f.read()
        # The late reads' bytes: none past `short_at` (getattr still says the whole size).
        self.late = self.data if short_at is None else self.data[:short_at]
        self.delay_s = delay_s
        self.from_offset = from_offset
        self.released = threading.Event()
        self.fd = os.open("/dev/fuse", os.O_RDWR)
        self.lock = threading.Lock()

    def reply(self, unique: int, body: bytes = b"", error: int = 0) -> None:
        msg = OUT_HEADER.pack(OUT_HEADER.size + len(body), -error, unique) + body
        with self.lock:
            try:
                os.write(self.fd, msg)
            except OSError:
                pass  # the request was interrupted or the mount is going away

    def attr(self) -> bytes:
        now = int(time.time())
        size = len(self.data)
        # ino, size, blocks, atime, mtime, ctime, their ns, mode, nlink, uid, gid, rdev,
        # blksize, flags
        return ATTR.pack(
            1,
            size,
            (size + 511) // 512,
            now,
            now,
            now,
            0,
            0,
            0,
            S_IFREG | 0o644,
            1,
            0,
            0,
            0,
            4096,
            0,
        )

    def late_read(self, unique: int, offset: int, size: int) -> None:
        self.released.wait(self.delay_s)
        self.reply(unique, self.late[offset : offset + size])

    def requests(self) -> Iterator[tuple[int, int, int, bytes]]:
        """The kernel's requests that want an answer (opcode, unique, node id, body),
        until the mount goes away."""
        while True:
            try:
                msg = os.read(self.fd, 1 << 20 | 4096)
            except OSError as exc:
                if exc.errno in (errno.EINTR, errno.EAGAIN, errno.ENOENT):
                    continue
                return  # ENODEV: unmounted
            _len, op, unique, node, *_ = IN_HEADER.unpack_from(msg)
            if op not in NO_REPLY:
                yield op, unique, node, msg[IN_HEADER.size :]

    def serve(self) -> None:
        for op, unique, _node, body in self.requests():
            if op == INIT:
                major, minor = struct.unpack_from("<II", body)
                # fuse_init_out: major, minor, readahead, flags, max_background,
                # congestion, max_write, time_gran, max_pages, map_alignment, flags2, ...
                out = struct.pack(
                    "<IIIIHHIIHHI", 7, min(minor, 31), 0, 0, 16, 12, 1 << 17, 1, 0, 0, 0
                )
                self.reply(unique, out.ljust(64, b"\0"))
            elif op in (GETATTR, LOOKUP):
                if op == LOOKUP:
                    self.reply(unique, error=errno.ENOENT)
                else:
                    self.reply(unique, struct.pack("<QII", 0, 0, 0) + self.attr())
            elif op == OPEN:
                self.reply(unique, struct.pack("<QIi", 1, FOPEN_DIRECT_IO, 0))
            elif op == READ:
                _fh, offset, size = struct.unpack_from("<QQI", body)
                if offset >= self.from_offset and not self.released.is_set():
                    threading.Thread(
                        target=self.late_read, args=(unique, offset, size), daemon=True
                    ).start()
                else:
                    self.reply(unique, self.data[offset : offset + size])
            elif op == STATFS:
                # fuse_kstatfs: blocks, bfree, bavail, files, ffree, bsize, namelen, frsize,
                # padding, spare[6]: a real server answers, so fstatfs says "fuse".
                self.reply(unique, struct.pack("<QQQQQIIII24x", 1, 0, 0, 1, 0, 4096, 255, 4096, 0))
            elif op in (RELEASE, FLUSH):
                self.reply(unique)
            elif op == DESTROY:
                self.reply(unique)
                return
            else:
                self.reply(unique, error=errno.ENOSYS)


def _mount(fd: int, target: str, rootmode: int = S_IFREG) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    opts = f"fd={fd},rootmode={rootmode:o},user_id=0,group_id=0,allow_other".encode()
    if libc.mount(b"bsrstall", target.encode(), b"fuse", 0, opts) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount fuse on {target}: {os.strerror(err)}")


def main() -> None:
    if sys.argv[1] == "--dir":
        dir_main(sys.argv[2:])
        return
    source, target, delay, offset, ready, *short = sys.argv[1:]
    server = _Server(source, float(delay), int(offset), int(short[0]) if short else None)
    signal.signal(signal.SIGUSR1, lambda *_: server.released.set())
    _mount(server.fd, target)
    Path(ready).write_text("mounted")
    server.serve()


class LateFile:
    """The running server: `release()` answers every held read now; `held()` lists the
    calls it held (op, path, seconds), when it logs them (`late_dir`'s `log`)."""

    def __init__(self, proc: subprocess.Popen[bytes], log: Path | None = None) -> None:
        self.proc = proc
        self.log = log

    def held(self) -> list[tuple[str, str, float]]:
        if self.log is None or not self.log.exists():
            return []
        rows = [line.split("\t") for line in self.log.read_text().splitlines()]
        return [(op, path, float(s)) for op, path, s in rows]

    def release(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGUSR1)


def _mounted(path: Path) -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == str(path) for line in f)


@contextmanager
def late_file(
    path: Path, delay_s: float, from_offset: int = 4096, short_at: int | None = None
) -> Iterator[LateFile]:
    """`path`'s reads at or past `from_offset` answered `delay_s` seconds late by the
    kernel's FUSE (see the module doc), with no bytes past `short_at` when given, until
    the block ends."""
    path = path.resolve()
    source = path.with_name(path.name + ".fuse-source")
    os.link(path, source)  # the server reads the real bytes from here
    ready = path.with_name(path.name + ".fuse-ready")
    args = [sys.executable, __file__, str(source), str(path), str(delay_s), str(from_offset)]
    args += [str(ready)] + ([] if short_at is None else [str(short_at)])
    try:
        with _serving(subprocess.Popen(args), path, ready) as late:
            yield late
    finally:
        source.unlink(missing_ok=True)


@contextmanager
def _serving(
    proc: subprocess.Popen[bytes], path: Path, ready: Path, log: Path | None = None
) -> Iterator[LateFile]:
    """The server `proc` once it has mounted `path`; unmounted and ended afterwards."""
    try:
        for _ in range(500):
            if ready.exists() and _mounted(path):
                break
            if proc.poll() is not None:
                raise RuntimeError(f"the FUSE server exited with {proc.returncode}")
            time.sleep(0.01)
        else:
            raise RuntimeError(f"{path} was not mounted within 5 s")
        yield LateFile(proc, log)
    finally:
        LateFile(proc).release()
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)
        try:
            proc.wait(2)  # it exits once the last open file of the mount is closed
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        ready.unlink(missing_ok=True)


# -- a directory whose chosen calls are answered late (`late_dir`) ---------------------------
SETATTR, MKDIR, UNLINK, RMDIR, RENAME, WRITE, FSYNC = 4, 9, 10, 11, 12, 16, 20
OPENDIR, READDIR, RELEASEDIR, FSYNCDIR, ACCESS, CREATE = 27, 28, 29, 30, 34, 35
S_IFDIR = 0o040000
FATTR_MODE, FATTR_SIZE = 1, 8
LATE_OPS = {
    "lookup": LOOKUP,  # a path's component: with suffix "", every path walk (a hung mount)
    "open": OPEN,
    "read": READ,
    "write": WRITE,
    "fsync": FSYNC,
    "getattr": GETATTR,
}
ENTRY = struct.Struct("<QQQQII")  # nodeid, generation, entry/attr valid (s, ns): all 0
OPEN_OUT = struct.Struct("<QIi")  # fh, open_flags, backing id


def _name(body: bytes, at: int = 0) -> str:
    return body[at : body.index(b"\0", at)].decode()


class _DirServer(_Server):
    """A pass-through of the directory `root_fd` (nodes by relative path, open files by
    backing descriptor); the calls named in `ops` on files whose name ends with `suffix`
    are answered after `delay_s` (or at `release()`), each on a thread of its own: on
    every `every`-th such file (in the order their first such call came), and with
    `per_file` only its first one. Each held call gets a line in `log` once answered."""

    def __init__(  # noqa: PLR0913
        self,
        root_fd: int,
        delay_s: float,
        ops: set[int],
        suffix: str,
        every: int = 1,
        per_file: bool = False,
        log: str = "",
    ) -> None:
        self.root = root_fd
        self.delay_s = delay_s
        self.ops = ops
        self.suffix = suffix
        self.every = every
        self.per_file = per_file
        self.log = log
        self.seen: dict[str, int] = {}  # file -> its place among the files called late
        self.stalled: set[str] = set()  # files whose one late call (`per_file`) came
        self.released = threading.Event()
        self.fd = os.open("/dev/fuse", os.O_RDWR)
        self.lock = threading.Lock()
        self.paths: dict[int, str] = {1: "."}
        self.ids: dict[str, int] = {".": 1}
        self.files: dict[int, int] = {}  # fh -> backing descriptor
        self.listings: dict[int, list[tuple[str, int]]] = {}
        self.next_id = 2

    def node(self, path: str) -> int:
        with self.lock:
            got = self.ids.get(path)
            if got is None:
                got = self.ids[path] = self.next_id
                self.paths[got] = path
                self.next_id += 1
            return got

    def child(self, parent: int, name: str) -> str:
        base = self.paths[parent]
        return name if base == "." else f"{base}/{name}"

    def stat_attr(self, st: os.stat_result, ino: int) -> bytes:
        times = [divmod(t, 10**9) for t in (st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns)]
        return ATTR.pack(
            ino, st.st_size, st.st_blocks, *(s for s, _ in times), *(ns for _, ns in times),
            st.st_mode, st.st_nlink, 0, 0, 0, 4096, 0,
        )  # fmt: skip

    def entry(self, path: str) -> bytes:
        st = os.stat(path, dir_fd=self.root, follow_symlinks=False)
        nid = self.node(path)
        return ENTRY.pack(nid, 0, 0, 0, 0, 0) + self.stat_attr(st, nid)

    def opened(self, fd: int) -> bytes:
        with self.lock:
            fh = self.next_id
            self.next_id += 1
            self.files[fh] = fd
        return OPEN_OUT.pack(fh, FOPEN_DIRECT_IO, 0)

    def late(self, op: int, node: int, body: bytes) -> bool:
        if op not in self.ops or self.released.is_set():
            return False
        if op in (LOOKUP, CREATE):
            path = self.child(node, _name(body, 16 if op == CREATE else 0))
        else:
            path = self.paths.get(node, "")
        if not path.endswith(self.suffix):
            return False
        with self.lock:
            place = self.seen.setdefault(path, len(self.seen) + 1)
            if place % self.every or path in self.stalled:
                return False
            if self.per_file:
                self.stalled.add(path)
        return True

    def answer(self, op: int, unique: int, node: int, body: bytes, late: bool) -> None:
        if late:
            t0 = time.monotonic()
            self.released.wait(self.delay_s)
            if self.log:
                name = next(k for k, v in LATE_OPS.items() if v == op)
                line = f"{name}\t{self.paths.get(node, '?')}\t{time.monotonic() - t0:.3f}\n"
                with self.lock, open(self.log, "a") as f:
                    f.write(line)
        try:
            self.reply(unique, self.handle(op, node, body))
        except OSError as exc:
            self.reply(unique, error=exc.errno or errno.EIO)

    def handle(self, op: int, node: int, body: bytes) -> bytes:  # noqa: C901, PLR0911, PLR0912
        path = self.paths.get(node)
        if path is None:
            raise OSError(errno.ESTALE, "unknown node")
        if op == LOOKUP:
            return self.entry(self.child(node, _name(body)))
        if op == GETATTR:
            st = os.stat(path, dir_fd=self.root, follow_symlinks=False)
            return struct.pack("<QII", 0, 0, 0) + self.stat_attr(st, node)
        if op == SETATTR:
            valid, _, _, size = struct.unpack_from("<IIQQ", body)
            mode = struct.unpack_from("<I", body, 68)[0]
            if valid & FATTR_SIZE:
                fd = os.open(path, os.O_WRONLY, dir_fd=self.root)
                try:
                    os.ftruncate(fd, size)
                finally:
                    os.close(fd)
            if valid & FATTR_MODE:
                os.chmod(path, mode & 0o7777, dir_fd=self.root)
            st = os.stat(path, dir_fd=self.root, follow_symlinks=False)
            return struct.pack("<QII", 0, 0, 0) + self.stat_attr(st, node)
        if op in (OPEN, CREATE):
            flags = struct.unpack_from("<I", body)[0] & (os.O_ACCMODE | os.O_APPEND)
            if op == OPEN:
                return self.opened(os.open(path, flags, dir_fd=self.root))
            mode = struct.unpack_from("<I", body, 4)[0]
            new = self.child(node, _name(body, 16))
            fd = os.open(new, flags | os.O_CREAT | os.O_EXCL, mode & 0o7777, dir_fd=self.root)
            return self.entry(new) + self.opened(fd)
        if op == READ:
            fh, offset, size = struct.unpack_from("<QQI", body)
            return os.pread(self.files[fh], size, offset)
        if op == WRITE:
            fh, offset, size = struct.unpack_from("<QQI", body)
            n = os.pwrite(self.files[fh], body[40 : 40 + size], offset)
            return struct.pack("<II", n, 0)
        if op == FSYNC:
            fh, flags = struct.unpack_from("<QI", body)
            (os.fdatasync if flags & 1 else os.fsync)(self.files[fh])
            return b""
        if op == RELEASE:
            with self.lock:
                fd = self.files.pop(struct.unpack_from("<Q", body)[0], -1)
            if fd >= 0:
                os.close(fd)
            return b""
        if op == MKDIR:
            mode = struct.unpack_from("<I", body)[0]
            new = self.child(node, _name(body, 8))
            os.mkdir(new, mode & 0o7777, dir_fd=self.root)
            return self.entry(new)
        if op in (UNLINK, RMDIR):
            gone = self.child(node, _name(body))
            (os.unlink if op == UNLINK else os.rmdir)(gone, dir_fd=self.root)
            with self.lock:
                self.paths.pop(self.ids.pop(gone, 0), None)
            return b""
        if op == RENAME:
            (newdir,) = struct.unpack_from("<Q", body)
            old_end = body.index(b"\0", 8)
            src = self.child(node, body[8:old_end].decode())
            dst = self.child(newdir, _name(body, old_end + 1))
            os.rename(src, dst, src_dir_fd=self.root, dst_dir_fd=self.root)
            with self.lock:  # the nodes below `src` now live below `dst`
                self.paths.pop(self.ids.pop(dst, 0), None)
                for p, nid in list(self.ids.items()):
                    if p == src or p.startswith(src + "/"):
                        del self.ids[p]
                        self.ids[dst + p[len(src) :]] = nid
                        self.paths[nid] = dst + p[len(src) :]
            return b""
        if op == OPENDIR:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY, dir_fd=self.root)
            try:
                names = [".", "..", *sorted(os.listdir(fd))]
            finally:
                os.close(fd)
            kinds = [S_IFDIR >> 12] * 2 + [
                os.stat(self.child(node, n), dir_fd=self.root, follow_symlinks=False).st_mode >> 12
                for n in names[2:]
            ]
            with self.lock:
                fh = self.next_id
                self.next_id += 1
                self.listings[fh] = list(zip(names, kinds, strict=True))
            return OPEN_OUT.pack(fh, 0, 0)
        if op == READDIR:
            fh, offset, size = struct.unpack_from("<QQI", body)
            out = b""
            for i, (name, kind) in enumerate(self.listings.get(fh, [])[offset:], offset + 1):
                raw = name.encode()
                dirent = struct.pack("<QQII", 1, i, len(raw), kind) + raw
                dirent += b"\0" * (-len(dirent) % 8)
                if len(out) + len(dirent) > size:
                    break
                out += dirent
            return out
        if op == RELEASEDIR:
            with self.lock:
                self.listings.pop(struct.unpack_from("<Q", body)[0], None)
            return b""
        if op == STATFS:
            v = os.fstatvfs(self.root)
            return struct.pack(
                "<QQQQQIIII24x", v.f_blocks, v.f_bfree, v.f_bavail, v.f_files, v.f_ffree,
                v.f_bsize, v.f_namemax, v.f_frsize, 0,
            )  # fmt: skip
        if op in (FLUSH, FSYNCDIR, ACCESS):
            return b""
        raise OSError(errno.ENOSYS, "not served")

    def serve(self) -> None:
        for op, unique, node, body in self.requests():
            if op == INIT:
                out = struct.pack("<IIIIHHIIHHI", 7, 31, 0, 0, 16, 12, 1 << 17, 1, 0, 0, 0)
                self.reply(unique, out.ljust(64, b"\0"))
            elif op == DESTROY:
                self.reply(unique)
                return
            elif self.late(op, node, body):
                args = (op, unique, node, body, True)
                threading.Thread(target=self.answer, args=args, daemon=True).start()
            else:
                self.answer(op, unique, node, body, False)


def dir_main(argv: list[str]) -> None:
    target, delay, ops, suffix, ready, *more = argv
    every, per_file, log = more or ("1", "0", "")
    root = os.open(target, os.O_RDONLY | os.O_DIRECTORY)  # what the mount will cover
    late_ops = {LATE_OPS[o] for o in ops.split(",")}
    server = _DirServer(root, float(delay), late_ops, suffix, int(every), per_file == "1", log)
    signal.signal(signal.SIGUSR1, lambda *_: server.released.set())
    _mount(server.fd, target, S_IFDIR)
    Path(ready).write_text("mounted")
    server.serve()


@contextmanager
def late_dir(  # noqa: PLR0913
    path: Path,
    delay_s: float,
    ops: Iterable[str],
    suffix: str,
    every: int = 1,
    per_file: bool = False,
    log: Path | None = None,
) -> Iterator[LateFile]:
    """The directory `path` served through the kernel's FUSE from its own contents until
    the block ends; each of `ops` ("lookup", "open", "read", "write", "fsync", "getattr")
    on a file below it whose name ends with `suffix` is answered `delay_s` seconds late (at once
    after `release()`): on every `every`-th such file, and with `per_file` only its first
    such call (one stall per file). Files open through the mount reply FOPEN_DIRECT_IO, as in
    `late_file`: every read and write is a request the server answers. With `log`, each
    held call is a line there (`LateFile.held()`)."""
    path = path.resolve()
    unknown = set(ops) - set(LATE_OPS)
    if unknown:
        raise ValueError(f"cannot answer {sorted(unknown)} late; one of {sorted(LATE_OPS)}")
    if every < 1:
        raise ValueError(f"every must be >= 1, not {every}")
    ready = path.with_name(path.name + ".fuse-ready")
    args = [sys.executable, __file__, "--dir", str(path), str(delay_s), ",".join(ops), suffix]
    args += [str(ready), str(every), "1" if per_file else "0", str(log or "")]
    with _serving(subprocess.Popen(args), path, ready, log) as late:
        yield late


if __name__ == "__main__":
    main()
