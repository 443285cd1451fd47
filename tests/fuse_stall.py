"""A real kernel stall: one file served through FUSE whose payload reads are answered late.

`late_file(path, delay_s)` mounts a one-file FUSE file system over `path` (a regular file:
the mount's root is that file), served by a process of its own that answers every READ at
or past `from_offset` only after `delay_s` seconds, with the file's real bytes. A reader's
request (an O_DIRECT read through io_uring or pread) is held in the kernel meanwhile: it
cannot be withdrawn, and its memory is written when the answer comes. Opens reply
FOPEN_DIRECT_IO, so the page cache never answers for the server.

The server speaks the kernel's FUSE protocol itself (<linux/fuse.h>, protocol 7.31 replies):
no libfuse, no Python package. It needs root and /dev/fuse. `release()` answers held reads
at once; leaving the block unmounts (`umount -l`) and waits for the server.

    python fuse_stall.py SOURCE MOUNTPOINT DELAY_S FROM_OFFSET READY_FILE
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
from collections.abc import Iterator
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
    def __init__(self, source: str, delay_s: float, from_offset: int) -> None:
        with open(source, "rb") as f:
            self.data = f.read()
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
        self.reply(unique, self.data[offset : offset + size])

    def serve(self) -> None:
        while True:
            try:
                msg = os.read(self.fd, 1 << 20 | 4096)
            except OSError as exc:
                if exc.errno in (errno.EINTR, errno.EAGAIN, errno.ENOENT):
                    continue
                return  # ENODEV: unmounted
            _len, op, unique, _node, *_ = IN_HEADER.unpack_from(msg)
            body = msg[IN_HEADER.size :]
            if op in NO_REPLY:
                continue
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


def _mount(fd: int, target: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    opts = f"fd={fd},rootmode={S_IFREG:o},user_id=0,group_id=0,allow_other".encode()
    if libc.mount(b"bsrstall", target.encode(), b"fuse", 0, opts) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount fuse on {target}: {os.strerror(err)}")


def main() -> None:
    source, target, delay, offset, ready = sys.argv[1:6]
    server = _Server(source, float(delay), int(offset))
    signal.signal(signal.SIGUSR1, lambda *_: server.released.set())
    _mount(server.fd, target)
    Path(ready).write_text("mounted")
    server.serve()


class LateFile:
    """The running server: `release()` answers every held read now."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc

    def release(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGUSR1)


def _mounted(path: Path) -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == str(path) for line in f)


@contextmanager
def late_file(path: Path, delay_s: float, from_offset: int = 4096) -> Iterator[LateFile]:
    """`path`'s reads at or past `from_offset` answered `delay_s` seconds late by the
    kernel's FUSE (see the module doc), until the block ends."""
    path = path.resolve()
    source = path.with_name(path.name + ".fuse-source")
    os.link(path, source)  # the server reads the real bytes from here
    ready = path.with_name(path.name + ".fuse-ready")
    args = [sys.executable, __file__, str(source), str(path), str(delay_s), str(from_offset)]
    proc = subprocess.Popen([*args, str(ready)])
    try:
        for _ in range(500):
            if ready.exists() and _mounted(path):
                break
            if proc.poll() is not None:
                raise RuntimeError(f"the FUSE server exited with {proc.returncode}")
            time.sleep(0.01)
        else:
            raise RuntimeError(f"{path} was not mounted within 5 s")
        yield LateFile(proc)
    finally:
        LateFile(proc).release()
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)
        try:
            proc.wait(2)  # it exits once the last open file of the mount is closed
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        source.unlink(missing_ok=True)
        ready.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
