"""Content-addressed kernel cache: keys, round trip, atomic writes, corruption, concurrency, fallback."""
import hashlib
import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

import cupyflash
from cupyflash import cache as cache_mod
from cupyflash.cache import ENTRY_SUFFIX, KernelCache, default_cache, default_cache_dir
from cupyflash.compiler import compile_count, compile_module, compile_options
from tiny_kernels import TINY_NAMES, TINY_SOURCE, tiny_source

TESTS_DIR = Path(__file__).resolve().parent


def _run_python(code: str, env_extra: dict | None = None) -> str:
    env = dict(os.environ, **(env_extra or {}))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# ----------------------------------------------------------------------------- keys
def test_key_is_deterministic_hex_sha256():
    k1 = KernelCache.key(TINY_SOURCE, TINY_NAMES, "sm_80")
    k2 = KernelCache.key(TINY_SOURCE, list(TINY_NAMES), "sm_80", compile_options("sm_80"))
    assert k1 == k2 and len(k1) == 64 and int(k1, 16) >= 0


def test_key_is_the_same_in_another_process():
    here = KernelCache.key(TINY_SOURCE, TINY_NAMES, "sm_90")
    there = _run_python("""
        from cupyflash.cache import KernelCache
        from tiny_kernels import TINY_SOURCE, TINY_NAMES
        print(KernelCache.key(TINY_SOURCE, TINY_NAMES, "sm_90"))
    """).strip()
    assert here == there


def test_key_changes_with_every_component(monkeypatch):
    base = KernelCache.key(TINY_SOURCE, TINY_NAMES, "sm_80")
    variants = {
        "source": KernelCache.key(TINY_SOURCE + " ", TINY_NAMES, "sm_80"),
        "names": KernelCache.key(TINY_SOURCE, TINY_NAMES[:1], "sm_80"),
        "name order": KernelCache.key(TINY_SOURCE, TINY_NAMES[::-1], "sm_80"),
        "options": KernelCache.key(TINY_SOURCE, TINY_NAMES, "sm_80", compile_options("sm_80") + ("-lineinfo",)),
        "arch": KernelCache.key(TINY_SOURCE, TINY_NAMES, "sm_90"),
        "arch variant": KernelCache.key(TINY_SOURCE, TINY_NAMES, "sm_90a"),
    }
    monkeypatch.setattr(cache_mod, "nvrtc_version", lambda: (99, 1))
    variants["nvrtc"] = KernelCache.key(TINY_SOURCE, TINY_NAMES, "sm_80")
    monkeypatch.undo()
    monkeypatch.setattr(cupyflash, "__version__", "999.0.0")
    variants["package version"] = KernelCache.key(TINY_SOURCE, TINY_NAMES, "sm_80")
    monkeypatch.undo()
    assert KernelCache.key(TINY_SOURCE, TINY_NAMES, "sm_80") == base
    for what, key in variants.items():
        assert key != base, what
    assert len(set(variants.values())) == len(variants)


def test_key_ignores_file_times(tmp_path):
    # The key is a function of content only: nothing on disk (mtimes) can change it.
    src = tmp_path / "k.cu"
    src.write_text(TINY_SOURCE)
    k1 = KernelCache.key(src.read_text(), TINY_NAMES, "sm_80")
    os.utime(src, (0, 0))
    assert KernelCache.key(src.read_text(), TINY_NAMES, "sm_80") == k1


# ----------------------------------------------------------------------------- round trip
def test_round_trip_through_disk(tmp_path):
    cache = KernelCache(tmp_path)
    before = compile_count()
    module = cache.get_or_compile(TINY_SOURCE, TINY_NAMES, "sm_80", short_forms=["tiny a", "tiny b"])
    assert compile_count() == before + 1
    key = KernelCache.key(TINY_SOURCE, TINY_NAMES, "sm_80")
    assert _files(tmp_path) == [key + ENTRY_SUFFIX]

    fresh = KernelCache(tmp_path)  # empty memory layer: must come from disk
    loaded = fresh.get(key)
    assert loaded == module  # every field but compile_seconds compares
    assert loaded.compile_seconds == pytest.approx(module.compile_seconds)
    assert fresh.get_or_compile(TINY_SOURCE, TINY_NAMES, "sm_80") == module
    assert compile_count() == before + 1

    meta = fresh.read_metadata(fresh.path_for(key))
    assert meta["key"] == key and meta["arch"] == "sm_80" and meta["binary_kind"] == "cubin"
    assert meta["short_forms"] == ["tiny a", "tiny b"]
    assert meta["cupyflash_version"] == cupyflash.__version__
    assert set(meta["resources"]) == set(TINY_NAMES)
    assert fresh.entries() == [fresh.path_for(key)]
    assert fresh.size_bytes() == fresh.path_for(key).stat().st_size > len(module.binary)


def test_lookup_reports_cached(tmp_path):
    cache = KernelCache(tmp_path)
    first = cache.lookup_or_compile(TINY_SOURCE, TINY_NAMES, "sm_90")
    second = cache.lookup_or_compile(TINY_SOURCE, TINY_NAMES, "sm_90")
    assert not first.cached and second.cached and first.key == second.key
    assert KernelCache(tmp_path).lookup_or_compile(TINY_SOURCE, TINY_NAMES, "sm_90").cached


def test_ptx_entries_round_trip(tmp_path):
    cache = KernelCache(tmp_path)
    module = cache.get_or_compile(TINY_SOURCE, TINY_NAMES, "compute_80")
    assert KernelCache(tmp_path).get(KernelCache.key(TINY_SOURCE, TINY_NAMES, "compute_80")) == module


def test_entries_are_world_readable(tmp_path):
    cache = KernelCache(tmp_path)
    cache.get_or_compile(TINY_SOURCE, TINY_NAMES, "sm_80")
    (entry,) = cache.entries()
    assert entry.stat().st_mode & 0o444 == 0o444


def test_missing_directory_is_created(tmp_path):
    directory = tmp_path / "a" / "b"
    KernelCache(directory).get_or_compile(TINY_SOURCE, TINY_NAMES, "sm_80")
    assert len(KernelCache(directory).entries()) == 1


def test_empty_or_missing_directory_inspection(tmp_path):
    cache = KernelCache(tmp_path / "nope")
    assert cache.entries() == [] and cache.size_bytes() == 0
    assert cache.get("0" * 64) is None


def test_default_cache_follows_env(tmp_path, monkeypatch):
    monkeypatch.setenv("CUPYFLASH_CACHE_DIR", str(tmp_path / "one"))
    one = default_cache()
    assert one.directory == tmp_path / "one" == default_cache_dir()
    assert default_cache() is one
    monkeypatch.setenv("CUPYFLASH_CACHE_DIR", str(tmp_path / "two"))
    assert default_cache().directory == tmp_path / "two"
    monkeypatch.delenv("CUPYFLASH_CACHE_DIR")
    assert default_cache_dir() == Path.home() / ".cache" / "cupyflash"


# ----------------------------------------------------------------------------- atomic writes
def test_write_leaves_no_temp_files(tmp_path):
    cache = KernelCache(tmp_path)
    for i in range(5):
        cache.get_or_compile(tiny_source(i), TINY_NAMES, "sm_80")
    names = _files(tmp_path)
    assert len(names) == 5 and all(n.endswith(ENTRY_SUFFIX) and not n.startswith(".") for n in names)


def test_failed_write_removes_temp_file_and_falls_back(tmp_path, monkeypatch):
    cache = KernelCache(tmp_path)

    def failing_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cache_mod.os, "replace", failing_replace)
    with pytest.warns(RuntimeWarning, match="not writable"):
        module = cache.get_or_compile(TINY_SOURCE, TINY_NAMES, "sm_80")
    assert _files(tmp_path) == []
    assert cache.memory_only
    assert cache.get(KernelCache.key(TINY_SOURCE, TINY_NAMES, "sm_80")) is module


# ----------------------------------------------------------------------------- corruption
def _good_entry(tmp_path) -> tuple[KernelCache, str, Path]:
    cache = KernelCache(tmp_path)
    cache.get_or_compile(TINY_SOURCE, TINY_NAMES, "sm_80")
    key = KernelCache.key(TINY_SOURCE, TINY_NAMES, "sm_80")
    return cache, key, cache.path_for(key)


def _assert_recompiled_and_repaired(tmp_path, key):
    fresh = KernelCache(tmp_path)
    assert fresh.get(key) is None
    before = compile_count()
    module = fresh.get_or_compile(TINY_SOURCE, TINY_NAMES, "sm_80")
    assert compile_count() == before + 1
    assert KernelCache(tmp_path).get(key) == module  # the bad entry was overwritten with a good one


@pytest.mark.parametrize("damage", [
    "truncate_half", "truncate_to_header", "empty", "flip_binary_byte", "flip_checksum", "garbage", "append",
])
def test_damaged_entry_is_a_miss_and_recompiled(tmp_path, damage):
    _, key, path = _good_entry(tmp_path)
    data = path.read_bytes()
    if damage == "truncate_half":
        data = data[: len(data) // 2]
    elif damage == "truncate_to_header":
        data = data[:24]
    elif damage == "empty":
        data = b""
    elif damage == "flip_binary_byte":
        data = bytearray(data)
        data[len(data) - 100] ^= 0xFF
        data = bytes(data)
    elif damage == "flip_checksum":
        data = data[:-1] + bytes([data[-1] ^ 1])
    elif damage == "garbage":
        data = os.urandom(4096)
    elif damage == "append":
        data = data + b"extra"
    path.write_bytes(data)
    _assert_recompiled_and_repaired(tmp_path, key)


def test_foreign_entry_under_wrong_name_is_a_miss(tmp_path):
    cache = KernelCache(tmp_path)
    cache.get_or_compile(tiny_source(1), TINY_NAMES, "sm_80")
    other_key = KernelCache.key(TINY_SOURCE, TINY_NAMES, "sm_80")
    only = cache.entries()[0]
    only.rename(cache.path_for(other_key))  # a valid file, but it is the entry of another key
    _assert_recompiled_and_repaired(tmp_path, other_key)


def test_valid_checksum_but_bad_metadata_is_a_miss(tmp_path):
    _, key, path = _good_entry(tmp_path)
    for meta in ({"key": key}, [1, 2, 3], {"key": key, "arch": "sm_80", "binary_kind": "cubin",
                                            "lowered_names": [], "resources": {}, "log": "",
                                            "nvrtc_version": [12, 9], "compile_seconds": 1.0}):
        meta_bytes = json.dumps(meta).encode()
        body = cache_mod._HEADER.pack(cache_mod._MAGIC, len(meta_bytes), 3) + meta_bytes + b"abc"
        path.write_bytes(body + hashlib.sha256(body).digest())
        assert KernelCache(tmp_path).get(key) is None
    _assert_recompiled_and_repaired(tmp_path, key)


def test_directory_in_place_of_entry_is_a_miss(tmp_path):
    cache = KernelCache(tmp_path / "c")
    key = KernelCache.key(TINY_SOURCE, TINY_NAMES, "sm_80")
    cache.path_for(key).mkdir(parents=True)
    assert cache.get(key) is None


# ----------------------------------------------------------------------------- unwritable directory
def test_unwritable_directory_falls_back_to_memory_with_one_warning(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    cache = KernelCache(blocker / "cache")  # cannot be created, even by root
    before = compile_count()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = cache.get_or_compile(TINY_SOURCE, TINY_NAMES, "sm_80")
        cache.get_or_compile(tiny_source(1), TINY_NAMES, "sm_80")
        cache.get_or_compile(tiny_source(2), TINY_NAMES, "sm_90")
        again = cache.get_or_compile(TINY_SOURCE, TINY_NAMES, "sm_80")
    ours = [w for w in caught if "cupyflash kernel cache" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert issubclass(ours[0].category, RuntimeWarning)
    assert str(blocker / "cache") in str(ours[0].message)
    assert cache.memory_only
    assert again is first  # served from memory
    assert compile_count() == before + 3
    assert cache.entries() == []


# ----------------------------------------------------------------------------- processes
def test_warm_cache_in_new_process_compiles_nothing(tmp_path):
    code = """
        from cupyflash.cache import KernelCache
        from cupyflash.compiler import compile_count
        from tiny_kernels import TINY_NAMES, tiny_source
        cache = KernelCache({d!r})
        for i in range(3):
            for arch in ("sm_80", "sm_90"):
                cache.get_or_compile(tiny_source(i), TINY_NAMES, arch)
        print(compile_count())
    """.format(d=str(tmp_path))
    assert _run_python(code).strip() == "6"
    assert len(KernelCache(tmp_path).entries()) == 6
    assert _run_python(code).strip() == "0"


def test_default_cache_env_in_new_process(tmp_path):
    code = """
        from cupyflash.cache import default_cache
        from cupyflash.compiler import compile_count
        from tiny_kernels import TINY_NAMES, TINY_SOURCE
        default_cache().get_or_compile(TINY_SOURCE, TINY_NAMES, "sm_80")
        print(compile_count(), default_cache().directory)
    """
    env = {"CUPYFLASH_CACHE_DIR": str(tmp_path)}
    assert _run_python(code, env).split() == ["1", str(tmp_path)]
    assert _run_python(code, env).split() == ["0", str(tmp_path)]


def test_concurrent_writers_of_the_same_key_end_with_a_valid_entry(tmp_path):
    # Several processes compile the same key, then keep rewriting it while others read it: every
    # read must be a complete entry or a miss, and the end state must be one valid entry.
    code = """
        import sys
        from cupyflash.cache import KernelCache
        from tiny_kernels import TINY_NAMES, TINY_SOURCE
        cache = KernelCache({d!r})
        module = cache.get_or_compile(TINY_SOURCE, TINY_NAMES, "sm_80")
        key = KernelCache.key(TINY_SOURCE, TINY_NAMES, "sm_80")
        bad = 0
        for _ in range(40):
            cache.put(key, module, short_forms=["writer"])
            got = KernelCache({d!r}).get(key)
            if got is None or got.binary != module.binary:
                bad += 1
        print(bad)
    """.format(d=str(tmp_path))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH")]))
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(6)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert out.strip() == "0"
    key = KernelCache.key(TINY_SOURCE, TINY_NAMES, "sm_80")
    assert _files(tmp_path) == [key + ENTRY_SUFFIX]
    module = KernelCache(tmp_path).get(key)
    assert module is not None and module == compile_module(TINY_SOURCE, TINY_NAMES, "sm_80")


def test_threads_asking_for_the_same_key_compile_once(tmp_path):
    import threading

    cache = KernelCache(tmp_path)
    before = compile_count()
    results = []
    barrier = threading.Barrier(8)

    def worker():
        barrier.wait()
        results.append(cache.get_or_compile(TINY_SOURCE, TINY_NAMES, "sm_90"))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert compile_count() == before + 1
    assert len(results) == 8 and all(r is results[0] for r in results)
