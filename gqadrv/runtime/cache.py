"""On-disk cache of compiled cubins.

Key: SHA-256 over the source closure, the NVRTC options, the NVRTC version and the target arch
(computed by the compiler). Entry file layout, all little-endian:

    b"GQADRVC1" | sha256(payload) (32 bytes) | len(payload) (8 bytes) | payload

so a truncated or corrupted entry is detected on read, reported as a miss and rebuilt. Writes go
to a temporary file in the same directory followed by ``os.replace``: concurrent processes never
observe a torn file, and the last writer of identical content wins harmlessly.

Entries live at ``<dir>/<key[:2]>/<key>.cubin.gq`` (key: 64 lowercase hex digits); temporary
files are ``<dir>/<key[:2]>/.<key[:16]>.*.tmp``. Only files of those two shapes are gqadrv's:
``clear()``, ``disk_usage()`` and eviction touch nothing else in the directory (it may be shared).

Size cap (GQADRV_CACHE_MAX_BYTES): after each write the cache sums its entries and, while they
exceed the cap, deletes the least recently used ones (oldest mtime first; a disk hit refreshes the
entry's mtime *before* reading it). It never deletes the entry it has just written nor an entry
used in the last ``EVICT_GRACE_S`` seconds, so an entry another process is reading is kept (on
POSIX an unlinked file stays readable through an open descriptor anyway; where deleting an open
file fails, the entry is skipped). The cap is therefore soft: a burst of fresh entries may exceed
it until they age. Concurrent evictions are harmless (a vanished file is skipped; a deleted entry
is a miss next time and is rebuilt).

Environment:
    GQADRV_CACHE_DIR        cache directory (default: $XDG_CACHE_HOME/gqadrv or ~/.cache/gqadrv)
    GQADRV_CACHE=0          disable the disk cache (an in-process memory cache is still used)
    GQADRV_CACHE_MAX_BYTES  size cap of the disk cache: bytes, or with a K/M/G (x1000) or
                            KiB/MiB/GiB suffix; unset, empty or 0: no cap

If the directory cannot be created or written, the cache falls back to memory with one warning.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import struct
import tempfile
import threading
import time
import warnings
from pathlib import Path

from .log import get_logger

MAGIC = b"GQADRVC1"
_HEADER = struct.Struct("<8s32sQ")
EVICT_GRACE_S = 60.0     # entries used (or written) this recently are never evicted
STALE_TMP_S = 3600.0     # temporary files older than this are leftovers of a killed writer
_ENTRY_RE = re.compile(r"^[0-9a-f]{64}\.cubin\.gq$")
_TMP_RE = re.compile(r"^\.[0-9a-f]{16}\..+\.tmp$")
_SUBDIR_RE = re.compile(r"^[0-9a-f]{2}$")
_log = get_logger("cache")

__all__ = ["CubinCache", "default_cache", "cache_dir", "cache_enabled", "cache_max_bytes", "parse_size"]


def cache_enabled() -> bool:
    return os.environ.get("GQADRV_CACHE", "1").strip().lower() not in ("0", "off", "false", "no")


def cache_dir() -> Path:
    env = os.environ.get("GQADRV_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gqadrv"


_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """'500M' -> 500_000_000, '2GiB' -> 2**31, '1048576' -> 1048576 (ValueError if malformed)."""
    m = re.match(r"^\s*(\d+(?:\.\d*)?)\s*([a-zA-Z]*)\s*$", str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise ValueError(f"invalid size {text!r}: expected bytes, optionally with K, M, G (x1000) or KiB, MiB, GiB")
    return int(float(m.group(1)) * _UNITS[unit])


def cache_max_bytes() -> int | None:
    """GQADRV_CACHE_MAX_BYTES as bytes; None: no cap (unset, empty, 0 or malformed, with a warning)."""
    env = os.environ.get("GQADRV_CACHE_MAX_BYTES", "").strip()
    if not env:
        return None
    try:
        n = parse_size(env)
    except ValueError as exc:
        warnings.warn(f"gqadrv: GQADRV_CACHE_MAX_BYTES: {exc}; the kernel cache has no size cap", RuntimeWarning,
                      stacklevel=2)
        return None
    return n or None


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

    def __init__(self, directory: Path | None, enabled: bool = True, max_bytes: int | None = None):
        self.directory = Path(directory) if directory is not None else None
        self.enabled = enabled and directory is not None
        self.max_bytes = int(max_bytes) if max_bytes else None
        self._memory: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._evict_lock = threading.Lock()
        self._warned = False
        self.hits = self.misses = self.corrupt = self.evicted = 0

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
        return self.lookup(key)[0]

    def lookup(self, key: str) -> tuple[bytes | None, str]:
        """(payload or None, where): where is "memory", "disk", "miss" or "corrupt" (a damaged
        disk entry, deleted and reported as a miss)."""
        with self._lock:
            hit = self._memory.get(key)
        if hit is not None:
            self.hits += 1
            return hit, "memory"
        if not self.enabled:
            self.misses += 1
            return None, "miss"
        path = self._path(key)
        try:
            os.utime(path)  # mark as recently used before reading: eviction keeps it (LRU by mtime)
        except FileNotFoundError:
            self.misses += 1
            return None, "miss"
        except OSError:
            pass  # a read-only cache directory: still readable, never evicted from here
        try:
            blob = path.read_bytes()
        except OSError:
            self.misses += 1
            return None, "miss"
        payload = decode_entry(blob)
        if payload is None:
            self.corrupt += 1
            self.misses += 1
            _log.info("cache entry %s is damaged: deleted, rebuilding", path)
            try:
                path.unlink()
            except OSError:
                pass
            return None, "corrupt"
        with self._lock:
            self._memory[key] = payload
        self.hits += 1
        return payload, "disk"

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
            return
        if self.max_bytes:
            self.enforce_cap(keep=path)

    def clear_memory(self) -> None:
        with self._lock:
            self._memory.clear()

    # ------------------------------------------------------------------ the directory
    def _files(self, tmp: bool = False):
        """(path, os.stat_result) of gqadrv's entries (``tmp``: its temporary files instead).
        Only ``<dir>/<2 hex>/<64 hex>.cubin.gq`` (``.<16 hex>.*.tmp``) files count; symbolic links
        and anything else in the directory are ignored."""
        if self.directory is None:
            return
        pattern = _TMP_RE if tmp else _ENTRY_RE
        try:
            subdirs = [d for d in os.scandir(self.directory)
                       if _SUBDIR_RE.match(d.name) and d.is_dir(follow_symlinks=False)]
        except OSError:
            return
        for d in subdirs:
            try:
                files = list(os.scandir(d.path))
            except OSError:
                continue
            for f in files:
                if not pattern.match(f.name) or (not tmp and not f.name.startswith(d.name)):
                    continue
                try:
                    st = f.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    yield Path(f.path), st

    def disk_usage(self) -> tuple[int, int]:
        """(number of entries, total bytes) on disk."""
        n = size = 0
        for _, st in self._files():
            n += 1
            size += st.st_size
        return n, size

    def info(self) -> dict:
        """dir, enabled, entries, bytes, max_bytes (the ``cache info`` / ``info --json`` fields)."""
        n, size = self.disk_usage()
        return {"dir": str(self.directory) if self.directory is not None else None, "enabled": self.enabled,
                "entries": n, "bytes": size, "max_bytes": self.max_bytes}

    def enforce_cap(self, keep: Path | None = None, now: float | None = None) -> tuple[int, int]:
        """Delete least recently used entries until the total is at most ``max_bytes``, sparing
        ``keep`` and entries used in the last EVICT_GRACE_S seconds. Returns (entries, bytes) deleted."""
        if not self.max_bytes or self.directory is None:
            return 0, 0
        with self._evict_lock:
            now = time.time() if now is None else now
            files = sorted(self._files(), key=lambda e: e[1].st_mtime)
            total = sum(st.st_size for _, st in files)
            n = freed = 0
            for path, st in files:
                if total <= self.max_bytes:
                    break
                if (keep is not None and path == keep) or now - st.st_mtime < EVICT_GRACE_S:
                    continue
                try:
                    path.unlink()
                except FileNotFoundError:
                    total -= st.st_size  # another process evicted it
                    continue
                except OSError:
                    continue  # open elsewhere (Windows) or not ours to delete: keep it
                total -= st.st_size
                n += 1
                freed += st.st_size
                _log.debug("cache: evicted %s (%d bytes, last used %.0f s ago)", path.name, st.st_size,
                           now - st.st_mtime)
            if n:
                self.evicted += n
                _log.info("cache: evicted %d least recently used entries (%d bytes) to stay under "
                          "GQADRV_CACHE_MAX_BYTES=%d; %d bytes remain", n, freed, self.max_bytes, total)
            return n, freed

    def clear(self) -> tuple[int, int]:
        """Delete every gqadrv entry (and temporary files older than STALE_TMP_S) from the directory
        and the memory mirror; remove the then-empty ``<2 hex>`` subdirectories. Nothing else in
        the directory is touched. Returns (entries, bytes) deleted."""
        self.clear_memory()
        n = freed = 0
        for path, st in self._files():
            try:
                path.unlink()
            except OSError:
                continue
            n += 1
            freed += st.st_size
        now = time.time()
        for path, st in self._files(tmp=True):
            if now - st.st_mtime > STALE_TMP_S:  # a younger one may belong to a writer right now
                try:
                    path.unlink()
                except OSError:
                    pass
        if self.directory is not None:
            try:
                subdirs = [d for d in os.scandir(self.directory)
                           if _SUBDIR_RE.match(d.name) and d.is_dir(follow_symlinks=False)]
            except OSError:
                subdirs = []
            for d in subdirs:
                try:
                    os.rmdir(d.path)  # only succeeds when empty
                except OSError:
                    pass
        _log.info("cache: cleared %d entries (%d bytes) from %s", n, freed, self.directory)
        return n, freed


_default: CubinCache | None = None
_default_lock = threading.Lock()


def default_cache() -> CubinCache:
    """The process-wide cache, configured from the environment on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = CubinCache(cache_dir(), enabled=cache_enabled(), max_bytes=cache_max_bytes())
        return _default


def reset_default_cache() -> None:
    """Forget the process-wide cache (the next use re-reads the environment)."""
    global _default
    with _default_lock:
        _default = None
