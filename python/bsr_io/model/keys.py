"""Prefix hashing and chunk keys.

Tokens are cut into chunks of `chunk_tokens`; chunk i's hash chains chunk i-1's hash
with chunk i's token ids, so a chunk key names the whole prefix up to its end. Each
link is blake2b-256 over a canonical encoding (the previous hash, little-endian int64
token ids), truncated to 128 bits, the same in every process and on every host. 128
bits keep a collision out of reach (2^64 work for a birthday pair, a second preimage
for a given prefix 2^128), where 64 bits let an adversary who controls prompts poison
a shared cache (vLLM's CVE-2025-25183). The chain continues from any hash
(`extend_prefix_hashes`), so a growing sequence is hashed once. A partial last chunk
has no key.
"""

from __future__ import annotations

import functools
import hashlib
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

import bsr_io._core as _core
from bsr_io.errors import BsrTypeError, BsrValueError

if TYPE_CHECKING:
    from bsr_io.model.layout import KVLayout

HASH_BITS = 128
_FINGERPRINT_RE = re.compile(r"^[0-9a-f]{32}$")
MAX_MODEL_BYTES = 1024


def _token_array(token_ids: Any) -> npt.NDArray[np.int64]:
    if token_ids is None or isinstance(token_ids, (str, bytes, dict, set)):
        raise BsrTypeError(
            "token ids must be a sequence of ints (list, numpy or torch), got "
            f"{type(token_ids).__name__}"
        )
    if hasattr(token_ids, "detach"):  # torch tensor, possibly on a GPU
        token_ids = token_ids.detach().cpu().numpy()
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise BsrValueError(f"token ids must be one-dimensional, got shape {tuple(arr.shape)}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise BsrValueError(f"token ids must be integers, got dtype {arr.dtype}")
    return arr.astype("<i8", copy=False)


def prefix_hashes(token_ids: Any, chunk_tokens: int) -> list[int]:
    """Chained 128-bit hashes of each full chunk of `token_ids` (list, numpy or torch)."""
    return extend_prefix_hashes([], token_ids, chunk_tokens)


def extend_prefix_hashes(
    prev_hashes: Sequence[int], token_ids: Any, chunk_tokens: int
) -> list[int]:
    """`prefix_hashes(token_ids, chunk_tokens)`, given the hashes of its first
    `len(prev_hashes)` chunks (computed earlier, e.g. before decode added tokens): only
    the chunks after them are hashed, chained on from the last one. `token_ids` is the
    whole sequence; the result lists every full chunk's hash, `prev_hashes` first."""
    if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise BsrValueError(f"chunk_tokens must be a positive int, got {chunk_tokens!r}")
    done = len(prev_hashes)
    tail: list[int] | bytes
    if isinstance(token_ids, list):
        # A list goes to Rust as it is: converting 512K ints to an array costs more than
        # hashing them.
        n = len(token_ids)
        tail = token_ids[done * chunk_tokens :] if done else token_ids
    else:
        tokens = _token_array(token_ids)
        n = len(tokens)
        tail = tokens[done * chunk_tokens :].tobytes()
    if done * chunk_tokens > n:
        raise BsrValueError(
            f"{done} earlier chunk hashes but only {n} tokens of {chunk_tokens} per chunk"
        )
    hashes = [int(h) for h in prev_hashes]
    try:
        # Rust (bsr_io._core), the GIL released while it hashes a long prompt: a scheduler
        # thread can hash 512K tokens without stalling the engine's other threads.
        hashes += _core.prefix_hashes(tail, chunk_tokens, hashes[-1] if hashes else 0)
    except (TypeError, OverflowError) as exc:
        why = str(exc)
        raise BsrValueError(
            why if why.startswith("token ids") else f"token ids must be int64 integers: {why}"
        ) from None
    return hashes


@functools.lru_cache(maxsize=256)  # a server keys every record of a handful of models
def model_digest(model: str) -> str:
    """32 hex chars naming a model in paths; the raw name never becomes a path component."""
    return hashlib.blake2b(model.encode("utf-8"), digest_size=16, person=b"bsr-model").hexdigest()


@dataclass(frozen=True, slots=True)
class ChunkKey:
    """Names one chunk record: model, world size, rank, layout and prefix hash.

    Two ranks, two models or two layouts never share a key, so they never share a record.
    """

    model: str
    world_size: int
    rank: int
    layout_fingerprint: str
    chunk_hash: int

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise BsrValueError(f"model must be a non-empty string, got {self.model!r}")
        if len(self.model.encode("utf-8")) > MAX_MODEL_BYTES:
            raise BsrValueError(f"model name longer than {MAX_MODEL_BYTES} bytes")
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise BsrValueError(f"world_size must be an int >= 1, got {self.world_size!r}")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise BsrValueError(f"rank must be in [0, {self.world_size}), got {self.rank!r}")
        if not isinstance(self.layout_fingerprint, str) or not _FINGERPRINT_RE.match(
            self.layout_fingerprint
        ):
            raise BsrValueError(
                "layout_fingerprint must be 32 lowercase hex chars (KVLayout.fingerprint()), "
                f"got {self.layout_fingerprint!r}"
            )
        if not isinstance(self.chunk_hash, int) or not 0 <= self.chunk_hash < 1 << HASH_BITS:
            raise BsrValueError(
                f"chunk_hash must be an unsigned {HASH_BITS}-bit int, got {self.chunk_hash!r}"
            )

    def to_bytes(self) -> bytes:
        """Canonical encoding (the form stored in record headers)."""
        model = self.model.encode("utf-8")
        return (
            struct.pack("<H", len(model))
            + model
            + struct.pack("<II", self.world_size, self.rank)
            + bytes.fromhex(self.layout_fingerprint)
            + self.chunk_hash.to_bytes(16, "little")
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> ChunkKey:
        """Inverse of `to_bytes`; ValueError if `data` is not exactly one encoded key."""
        try:
            (n,) = struct.unpack_from("<H", data, 0)
            model = bytes(data[2 : 2 + n]).decode("utf-8")
            world_size, rank = struct.unpack_from("<II", data, 2 + n)
            fp = bytes(data[10 + n : 26 + n]).hex()
            raw_hash = bytes(data[26 + n : 42 + n])
        except (struct.error, UnicodeDecodeError) as exc:
            raise BsrValueError(f"not an encoded chunk key: {exc}") from None
        if len(fp) != 32 or len(raw_hash) != 16:
            raise BsrValueError("not an encoded chunk key: truncated")
        if len(data) != 42 + n:
            raise BsrValueError(f"encoded chunk key has {len(data) - 42 - n} trailing bytes")
        chunk_hash = int.from_bytes(raw_hash, "little")
        return cls(model, world_size, rank, fp, chunk_hash)

    def hex(self) -> str:
        """32 hex chars identifying the key (a digest of `to_bytes`)."""
        return hashlib.blake2b(self.to_bytes(), digest_size=16, person=b"bsr-key").hexdigest()

    def identity_digest(self) -> bytes:
        """32 bytes binding everything the key stands for (the caller's model identity
        string, world size, rank, layout, the prefix hash): what a record header
        carries and a reader recomputes from the key it asked for."""
        return hashlib.blake2b(self.to_bytes(), digest_size=32, person=b"bsr-identity").digest()

    def namespace(self) -> str:
        """Directory name for this key's model, layout and rank: hex and digits only."""
        return (
            f"{model_digest(self.model)}-{self.layout_fingerprint}-w{self.world_size}r{self.rank}"
        )

    def file_stem(self) -> str:
        """File name (without suffix) for this key's record inside its namespace."""
        return f"{self.chunk_hash:032x}"

    def short(self) -> str:
        return f"{self.model}/w{self.world_size}r{self.rank}/{self.chunk_hash:032x}"


def chunk_keys(
    token_ids: Any,
    layout: KVLayout,
    model: str,
    rank: int = 0,
    world_size: int = 1,
) -> list[ChunkKey]:
    """Keys of every full chunk of `token_ids` for one rank of `layout`."""
    fp = layout.fingerprint()
    return [
        ChunkKey(model, world_size, rank, fp, h)
        for h in prefix_hashes(token_ids, layout.chunk_tokens)
    ]
