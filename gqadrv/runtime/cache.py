"""On-disk cache of compiled cubins.

Key: SHA-256 over the source closure, the NVRTC options, the NVRTC version and the target arch
(computed by the compiler). Entry file layout, all little-endian:

    b"GQADRVC1" | sha256(payload) (32 bytes) | len(payload) (8 bytes) | payload

so a truncated or corrupted entry is detected on read, reported as a miss and rebuilt. Writes go
to a temporary file in the same directory followed by ``os.replace``: concurrent processes never
observe a torn file, and the last writer of identical content wins harmlessly.

Environment:
    GQADRV_CACHE_DIR   cache directory (default: $XDG_CACHE_HOME/gqadrv or ~/.cache/gqadrv)
    GQADRV_CACHE=0     disable the disk cache (an in-process memory cache is still used)

If the directory cannot be created or written, the cache falls back to memory with one warning.
"""

from __future__ import annotations

import hashlib
import os
import struct
import tempfile
import threading
import warnings
from pathlib import Path

MAGIC = b"GQADRVC1"
_HEADER = struct.Struct("<8s32sQ")

__all__ = ["CubinCache", "default_cache", "cache_dir", "cache_enabled"]


def cache_enabled() -> bool:
    return os.environ.get("GQADRV_CACHE", "1").strip().lower() not in ("0", "off", "false", "no")


def cache_dir() -> Path:
    env = os.environ.get("GQADRV_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gqadrv"


def encode_entry(payload: bytes) -> bytes:
    return _HEADER.pack(MAGIC, hashlib.sha256(payload).digest(), len(payload)) + payload


def decode_entry(blob: bytes) -> bytes | None:
    """The payload, or None if the blob is not an intact entry."""
    if len(blob) < _HEADER.size:
        return None
    magic, digest, n = _HEADER.unpack_from(blob, 0)
    payload = blob[_HEADER.size:]
    if magic != MAGIC or n != len(payload) or hashlib.sha256(payload).digest() != digest:
        return None
    return payload


class CubinCache:
    """Key -> payload bytes, on disk when possible, always mirrored in memory."""

    def __init__(self, directory: Path | None, enabled: bool = True):
        self.directory = Path(directory) if directory is not None else None
        self.enabled = enabled and directory is not None
        self._memory: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._warned = False
        self.hits = self.misses = self.corrupt = 0

    def _path(self, key: str) -> Path:
        return self.directory / key[:2] / f"{key}.cubin.gq"

    def _disable(self, why: str) -> None:
        if not self._warned:
            warnings.warn(
                f"gqadrv: kernel cache directory {self.directory} is not usable ({why}); "
                "caching compiled kernels in memory only for this process",
                RuntimeWarning,
                stacklevel=3,
            )
            self._warned = True
        self.enabled = False

    def get(self, key: str) -> bytes | None:
        with self._lock:
            hit = self._memory.get(key)
        if hit is not None:
            self.hits += 1
            return hit
        if not self.enabled:
            self.misses += 1
            return None
        path = self._path(key)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            self.misses += 1
            return None
        except OSError:
            self.misses += 1
            return None
        payload = decode_entry(blob)
        if payload is None:
            self.corrupt += 1
            self.misses += 1
            try:
                path.unlink()
            except OSError:
                pass
            return None
        with self._lock:
            self._memory[key] = payload
        self.hits += 1
        return payload

    def put(self, key: str, payload: bytes) -> None:
        with self._lock:
            self._memory[key] = payload
        if not self.enabled:
            return
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{key[:16]}.", suffix=".tmp", dir=path.parent)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(encode_entry(payload))
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
        except OSError as exc:
            self._disable(str(exc))

    def clear_memory(self) -> None:
        with self._lock:
            self._memory.clear()

    def disk_usage(self) -> tuple[int, int]:
        """(number of entries, total bytes) on disk."""
        if self.directory is None or not self.directory.is_dir():
            return 0, 0
        n = size = 0
        for p in self.directory.rglob("*.cubin.gq"):
            try:
                size += p.stat().st_size
                n += 1
            except OSError:
                pass
        return n, size


_default: CubinCache | None = None
_default_lock = threading.Lock()


def default_cache() -> CubinCache:
    """The process-wide cache, configured from the environment on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = CubinCache(cache_dir(), enabled=cache_enabled())
        return _default


def reset_default_cache() -> None:
    """Forget the process-wide cache (the next use re-reads the environment)."""
    global _default
    with _default_lock:
        _default = None
