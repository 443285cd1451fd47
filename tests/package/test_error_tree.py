"""One root: every error bsr-io raises for a reason of its own is a `BsrError`; the
engine's are also `OSError`s with errno. Each raised for real, beside a control."""

import errno

import pytest

import bsr_io
from bsr_io import (
    BsrError,
    BsrIoError,
    BsrTypeError,
    BsrValueError,
    ChunkMissing,
    Engine,
    FileMissingError,
    LayoutError,
    MemoryTier,
    NoFreeSlot,
    RecordFormatError,
    WaitTimeoutError,
    prefix_hashes,
)
from bsr_io.model.layout import preset
from bsr_io.model.record import HEADER_BYTES, decode_header


def test_every_exported_error_has_the_one_root():
    public = [getattr(bsr_io, name) for name in bsr_io.__all__]
    errors = [v for v in public if isinstance(v, type) and issubclass(v, BaseException)]
    assert len(errors) >= 18  # engine, chunk, layout, capacity, record format, busy
    assert [e.__name__ for e in errors if not issubclass(e, BsrError)] == []
    # Engine errors are OSErrors too; the store's are not.
    assert issubclass(BsrIoError, OSError) and not issubclass(ChunkMissing, OSError)
    assert issubclass(WaitTimeoutError, TimeoutError)
    assert not issubclass(ValueError, BsrError)  # control: the check can say no
    # Bad arguments: bsr-io's own errors and the built-ins, with the usual message.
    assert issubclass(BsrValueError, ValueError) and issubclass(BsrTypeError, TypeError)
    assert issubclass(LayoutError, BsrValueError) and not issubclass(BsrValueError, OSError)
    assert str(BsrValueError("window must be at least 1, got 0")) == (
        "window must be at least 1, got 0"
    )


def test_engine_errors_raised_for_real(tmp_path):
    with Engine(1, 4096) as eng:
        with pytest.raises(BsrError) as missing:
            eng.open(tmp_path / "absent")
        assert type(missing.value) is FileMissingError
        assert isinstance(missing.value, FileNotFoundError)
        assert missing.value.errno == errno.ENOENT
        with eng.lease():
            with pytest.raises(BsrError) as full:
                eng.lease()
        assert type(full.value) is NoFreeSlot and full.value.errno == errno.EAGAIN
        (tmp_path / "f").write_bytes(b"\0" * 4096)
        with eng.open(tmp_path / "f") as f, pytest.raises(ValueError) as bad:
            eng.submit_read(f, -1, 4096)
        # A bad argument is bsr-io's own error and the built-in a caller expects.
        assert type(bad.value) is BsrValueError and isinstance(bad.value, BsrError)
        with pytest.raises(TypeError) as tokens:
            prefix_hashes("abc", 4)
        assert type(tokens.value) is BsrTypeError


def test_store_errors_raised_for_real():
    lay = preset("tiny")
    with pytest.raises(BsrError) as bad_header:
        decode_header(b"\0" * HEADER_BYTES)
    assert type(bad_header.value) is RecordFormatError
    assert isinstance(bad_header.value, ValueError)
    with pytest.raises(BsrError) as wrong_size:
        MemoryTier(1 << 20).write(
            bsr_io.chunk_keys(list(range(lay.chunk_tokens)), lay, "m")[0], b"x", lay
        )
    assert type(wrong_size.value) is LayoutError
