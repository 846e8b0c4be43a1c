"""Cache size cap (LRU eviction), cache clear, compile logging (GQADRV_LOG) and the target-arch helpers
(CPU only)."""

import logging
import os
import subprocess
import sys
import threading
import time
import warnings

import pytest

from gqadrv.runtime import cache as cache_mod
from gqadrv.runtime import log as log_mod
from gqadrv.runtime.cache import CubinCache, decode_entry, parse_size
from gqadrv.runtime.compiler import (
    ARCHES,
    arch_for_cc,
    build_arch,
    cc_for_arch,
    check_target_arch,
    compile_module,
    target_arches,
)


def key(i: int) -> str:
    return f"{i:02x}" + f"{i:062x}"


def age(c: CubinCache, k: str, seconds_ago: float) -> None:
    t = time.time() - seconds_ago
    os.utime(c._path(k), (t, t))


def entries(c: CubinCache) -> set:
    return {p.name.split(".")[0] for p, _ in c._files()}


# ----------------------------------------------------------------------------- size cap
def test_parse_size():
    assert parse_size("1048576") == 1048576
    assert parse_size("500M") == 500_000_000 and parse_size("500 mb") == 500_000_000
    assert parse_size("2GiB") == 2 << 30 and parse_size("1.5k") == 1500 and parse_size("64KiB") == 65536
    for bad in ("", "ten", "5X", "-1", "1e9"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_max_bytes_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("GQADRV_CACHE_DIR", str(tmp_path))
    for text, want in (("", None), ("0", None), ("10M", 10_000_000), ("4096", 4096)):
        monkeypatch.setenv("GQADRV_CACHE_MAX_BYTES", text)
        cache_mod.reset_default_cache()
        assert cache_mod.default_cache().max_bytes == want
    monkeypatch.setenv("GQADRV_CACHE_MAX_BYTES", "lots")
    cache_mod.reset_default_cache()
    with pytest.warns(RuntimeWarning, match="GQADRV_CACHE_MAX_BYTES"):
        assert cache_mod.default_cache().max_bytes is None
    cache_mod.reset_default_cache()


def test_size_cap_evicts_least_recently_used_on_write(tmp_path):
    c = CubinCache(tmp_path)
    payload = b"x" * 1000
    for i in range(5):
        c.put(key(i), payload)
    size = next(iter(c._files()))[1].st_size
    for i in range(5):
        age(c, key(i), 1000 - i * 100)  # key(0) is the oldest
    # an entry read now counts as recently used, whatever its age: key(1) was read by another process
    reader = CubinCache(tmp_path)
    assert reader.get(key(1)) == payload
    c.max_bytes = 3 * size
    c.put(key(9), payload)  # six entries: evict down to three
    assert entries(c) == {key(1), key(4), key(9)}
    assert c.evicted == 3 and c.disk_usage() == (3, 3 * size)
    # an evicted entry is a miss in a fresh process and is rebuilt; survivors still read intact
    fresh = CubinCache(tmp_path)
    assert fresh.get(key(0)) is None and fresh.get(key(4)) == payload


def test_size_cap_spares_the_new_entry_and_recent_ones(tmp_path):
    c = CubinCache(tmp_path, max_bytes=10)  # smaller than any entry
    c.put(key(1), b"a" * 100)
    c.put(key(2), b"b" * 100)  # key(1) is younger than the grace period: kept (soft cap)
    assert entries(c) == {key(1), key(2)}
    age(c, key(1), cache_mod.EVICT_GRACE_S + 5)
    age(c, key(2), cache_mod.EVICT_GRACE_S + 1)
    c.put(key(3), b"c" * 100)
    assert entries(c) == {key(3)}  # never the entry just written


def test_eviction_counts_only_gqadrv_entries(tmp_path):
    c = CubinCache(tmp_path)
    c.put(key(1), b"a" * 100)
    age(c, key(1), 1000)
    (tmp_path / "big.bin").write_bytes(b"z" * 100000)  # not an entry: neither counted nor deleted
    (tmp_path / key(1)[:2] / "notes.txt").write_text("keep")
    c.max_bytes = 1000
    c.put(key(2), b"b" * 100)
    assert entries(c) == {key(1), key(2)}
    assert (tmp_path / "big.bin").exists() and (tmp_path / key(1)[:2] / "notes.txt").exists()


def test_concurrent_writers_and_readers_under_a_cap(tmp_path, monkeypatch):
    monkeypatch.setattr(cache_mod, "EVICT_GRACE_S", 0.0)  # evict as eagerly as possible
    payloads = {key(i): bytes([i]) * (2000 + i) for i in range(40)}
    errors = []

    def writer(ks):
        c = CubinCache(tmp_path, max_bytes=6000)
        for k in ks:
            c.put(k, payloads[k])

    def reader():
        c = CubinCache(tmp_path)
        for _ in range(200):
            for k in list(payloads)[::7]:
                c.clear_memory()
                got = c.get(k)
                if got is not None and got != payloads[k]:
                    errors.append(k)
        if c.corrupt:
            errors.append("corrupt")

    ks = list(payloads)
    threads = [threading.Thread(target=writer, args=(ks[i::4],)) for i in range(4)]
    threads += [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for p, _ in CubinCache(tmp_path)._files():
        assert decode_entry(p.read_bytes()) is not None
    assert not list(tmp_path.rglob("*.tmp"))


def test_read_only_hit_still_works(tmp_path):
    c = CubinCache(tmp_path)
    c.put(key(1), b"abc")
    d = tmp_path / key(1)[:2]
    os.chmod(d, 0o555)
    try:
        assert CubinCache(tmp_path).get(key(1)) == b"abc"
    finally:
        os.chmod(d, 0o755)


# ----------------------------------------------------------------------------- clear / info
def test_clear_removes_only_gqadrv_files(tmp_path):
    c = CubinCache(tmp_path)
    for i in range(3):
        c.put(key(i), b"p" * 10)
    sub = tmp_path / key(0)[:2]
    old_tmp = sub / f".{key(0)[:16]}.abc.tmp"
    young_tmp = sub / f".{key(0)[:16]}.def.tmp"
    old_tmp.write_bytes(b"half")
    young_tmp.write_bytes(b"being written")
    t = time.time() - cache_mod.STALE_TMP_S - 10
    os.utime(old_tmp, (t, t))
    (tmp_path / "zz").mkdir()
    (tmp_path / "zz" / (key(5) + ".cubin.gq")).write_bytes(b"not in a hex subdir")
    (tmp_path / "other.cubin.gq").write_bytes(b"not at the right depth")
    elsewhere = tmp_path.parent / (tmp_path.name + "_elsewhere")
    elsewhere.mkdir()
    (elsewhere / (key(7) + ".cubin.gq")).write_bytes(b"behind a symlink")
    os.symlink(elsewhere, tmp_path / key(7)[:2])
    assert c.info() == {"dir": str(tmp_path), "enabled": True, "entries": 3, "bytes": c.disk_usage()[1], "max_bytes": None}
    n, freed = c.clear()
    assert n == 3 and freed > 0 and c.get(key(0)) is None  # memory mirror cleared too
    assert not old_tmp.exists() and young_tmp.exists()
    assert (tmp_path / "zz" / (key(5) + ".cubin.gq")).exists() and (tmp_path / "other.cubin.gq").exists()
    assert (elsewhere / (key(7) + ".cubin.gq")).exists()
    assert not (tmp_path / key(1)[:2]).exists()  # emptied subdirectories are removed
    assert c.disk_usage() == (0, 0)


def test_clear_of_a_missing_directory(tmp_path):
    assert CubinCache(tmp_path / "none").clear() == (0, 0)
    assert CubinCache(None, False).info()["entries"] == 0


# ----------------------------------------------------------------------------- logging
@pytest.fixture
def gqadrv_logger():
    lg = logging.getLogger("gqadrv")
    level, handlers = lg.level, list(lg.handlers)
    yield lg
    lg.setLevel(level)
    for h in list(lg.handlers):
        if h not in handlers:
            lg.removeHandler(h)


def test_compiles_are_logged(tmp_path, caplog, gqadrv_logger):
    caplog.set_level(logging.DEBUG, logger="gqadrv")
    c = CubinCache(tmp_path)
    compile_module("runtime/stream_read.cu", "sm_80", cache=c, label="ceiling")
    recs = [r for r in caplog.records if r.name.startswith("gqadrv")]
    info = [r.getMessage() for r in recs if r.levelno == logging.INFO]
    assert len(info) == 1 and info[0].startswith("ceiling for sm_80: cache miss, compiled in ")
    assert recs[0].name == "gqadrv.compiler"
    assert any("stream_read" in r.getMessage() and "registers" in r.getMessage() for r in recs if r.levelno == logging.DEBUG)
    caplog.clear()
    compile_module("runtime/stream_read.cu", "sm_80", cache=CubinCache(tmp_path))  # another process: disk hit
    compile_module("runtime/stream_read.cu", "sm_80", cache=c)  # this one: memory hit, DEBUG only
    got = [(r.levelno, r.getMessage()) for r in caplog.records
           if r.name == "gqadrv.compiler" and "cache hit" in r.getMessage()]
    assert got[0][0] == logging.INFO and got[0][1].startswith("runtime/stream_read.cu for sm_80: cache hit (disk)")
    assert got[1][0] == logging.DEBUG and "cache hit (memory)" in got[1][1]


def test_evictions_are_logged(tmp_path, caplog, gqadrv_logger):
    caplog.set_level(logging.INFO, logger="gqadrv")
    c = CubinCache(tmp_path)
    c.put(key(1), b"a" * 100)
    age(c, key(1), 1000)
    c.max_bytes = 150
    c.put(key(2), b"b" * 100)
    assert any("evicted 1 least recently used" in r.getMessage() for r in caplog.records)


def test_nothing_is_configured_without_gqadrv_log(gqadrv_logger):
    h = log_mod.configure_from_env({})
    assert h is None
    assert not [x for x in gqadrv_logger.handlers if getattr(x, "_gqadrv_env", False)]
    assert all(isinstance(x, logging.NullHandler) for x in gqadrv_logger.handlers)


def test_gqadrv_log_installs_one_stderr_handler(gqadrv_logger):
    for value, level in (("info", logging.INFO), ("DEBUG", logging.DEBUG), ("30", 30)):
        h = log_mod.configure_from_env({"GQADRV_LOG": value})
        assert gqadrv_logger.level == level and h.stream is sys.stderr
        assert [x for x in gqadrv_logger.handlers if getattr(x, "_gqadrv_env", False)] == [h]  # replaced, not added
    assert log_mod.configure_from_env({"GQADRV_LOG": ""}) is None
    assert not [x for x in gqadrv_logger.handlers if getattr(x, "_gqadrv_env", False)]
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert log_mod.configure_from_env({"GQADRV_LOG": "chatty"}) is None
    assert any("GQADRV_LOG" in str(x.message) for x in w)


def test_gqadrv_log_env_in_a_process(tmp_path):
    env = dict(os.environ, GQADRV_CACHE_DIR=str(tmp_path), GQADRV_LOG="info")
    cmd = [sys.executable, "-m", "gqadrv", "compile", "--arch", "sm_80", "--only", "short_float16_d64_r8_*"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "gqadrv INFO: short_float16_d64_r8_w4t16s1 for sm_80: cache miss, compiled in " in r.stderr
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert "gqadrv INFO: short_float16_d64_r8_w4t16s1 for sm_80: cache hit (disk)" in r.stderr
    env.pop("GQADRV_LOG")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stderr == ""


# ----------------------------------------------------------------------------- targets
def test_target_arches_cover_what_the_runtime_picks():
    ccs = ((8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (11, 0), (12, 0))
    for cc in ccs:
        a = arch_for_cc(cc)
        assert a in target_arches() and check_target_arch(a.upper()) == a and cc_for_arch(a) == cc
    assert set(ARCHES) <= set(target_arches())
    for bad in ("sm_90", "sm_101a", "sm_75", "sm_100", "hopper"):
        with pytest.raises(ValueError, match="sm_86"):
            check_target_arch(bad)


def test_build_arch():
    assert [build_arch(a) for a in ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_100a", "sm_103a", "sm_110a", "sm_120")] == \
        ["sm_80", "sm_80", "sm_80", "sm_90a", "sm_100a", "sm_80", "sm_110a", "sm_80"]
