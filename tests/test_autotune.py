"""Tuning tables, the cfg=None lookup order, and the autotune loop (CPU only).

The autotune loop itself runs here against a stand-in for CuPy built on numpy: the real
input generation, poisoning and float64 spot check run unchanged, only the kernel launch (an
exact numpy attention), the compile step and the event timer are replaced. The timings those
fakes return are test fixtures, not measurements.
"""
from __future__ import annotations

import contextlib
import json
import math
import types
import warnings

import numpy as np
import pytest

from cupyflash import api, benchmarking
from cupyflash.families.forward_sm80 import tuning as forward_tuning
from cupyflash.tuning import tables as tuning
from cupyflash.families.forward_sm80 import config_sets
from cupyflash.config import DType
from cupyflash.tuning import SEQ_BUCKETS, TuningTable, TuningTableError, pick_bucket

H100 = "NVIDIA H100 80GB HBM3"
A100 = "NVIDIA A100-SXM4-80GB"
TUNE_BF16_128 = config_sets.autotune_configs([DType.BF16], [128])
CFG_A = TUNE_BF16_128[0]
CFG_B = TUNE_BF16_128[-1]   # B_r = 128
DEFAULT = config_sets.default_config(DType.BF16, 128)


@pytest.fixture(autouse=True)
def isolated_tables(tmp_path, monkeypatch):
    """Private cache dir and shipped-table dir, fresh caches, no real GPU name."""
    cache = tmp_path / "cache"
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    monkeypatch.setenv("CUPYFLASH_CACHE_DIR", str(cache))
    monkeypatch.setattr(tuning, "default_tables_dir", lambda: shipped)
    tuning.clear_caches()
    yield types.SimpleNamespace(cache=cache, shipped=shipped)
    tuning.clear_caches()


def _table(entries, device=None, match=None) -> TuningTable:
    t = TuningTable(device=device, match=match)
    for cfg, seq in entries:
        t.set(cfg, seq, tflops=100.0, ms=1.0)
    return t


# ----------------------------------------------------------------------------- TuningTable
def test_causal_rows_round_trip_and_fall_back(tmp_path):
    t = _table([(CFG_A, 512), (CFG_A, 4096)], match="H100")
    t.set(CFG_B, 2048, tflops=90.0, ms=1.0, causal=True)
    back = TuningTable.load(t.save(tmp_path / "t.json"))
    assert back.to_dict() == t.to_dict()
    raw = json.loads((tmp_path / "t.json").read_text())["entries"]
    assert [e.get("causal") for e in raw] == [None, None, True]  # written only where true
    # causal problems use the causal rows of their (dtype, d_head) (their own buckets) ...
    assert back.lookup(H100, DType.BF16, 128, 8192, causal=True) == CFG_B
    assert back.lookup(H100, DType.BF16, 128, 100, causal=True) == CFG_B
    assert back.lookup(H100, DType.BF16, 128, 8192) == CFG_A  # ... non-causal ones never do
    # ... and fall back to the non-causal rows where there are no causal ones
    fp16 = config_sets.default_config(DType.FP16, 128)
    back.set(fp16, 512)
    assert back.lookup(H100, DType.FP16, 128, 4096, causal=True) == fp16
    bad = t.to_dict()
    bad["entries"][2]["causal"] = "yes"
    with pytest.raises(TuningTableError, match="causal"):
        TuningTable.from_dict(bad)
    with pytest.raises(TypeError, match="causal"):
        t.set(CFG_A, 512, causal=1)


def test_round_trip_json(tmp_path):
    t = _table([(CFG_A, 512), (CFG_B, 4096)], device=H100)
    t.set(config_sets.default_config(DType.FP16, 64), 1024, tflops=250.5, ms=0.25, heuristic_tflops=200.0)
    t.meta = {"date": "d", "versions": {"cupyflash": "0.1.0"}}
    path = t.save(tmp_path / "sub" / "t.json")
    back = TuningTable.load(path)
    assert back.to_dict() == t.to_dict()
    assert [e.config for e in back.entries()] == [e.config for e in t.entries()]
    assert back.get(DType.FP16, 64, 1024).info == {"heuristic_tflops": 200.0}
    assert json.loads(path.read_text())["schema"] == tuning.SCHEMA


@pytest.mark.parametrize("seq,bucket", [(512, 512), (700, 512), (1023, 512), (1024, 1024), (300, 512),
                                        (16384, 16384), (100000, 16384), (5000, 4096)])
def test_bucket_is_largest_at_or_below_else_smallest(seq, bucket):
    assert pick_bucket(SEQ_BUCKETS, seq) == bucket


def test_bucket_with_gaps_and_empty():
    assert pick_bucket([1024, 4096], 2048) == 1024
    assert pick_bucket([1024, 4096], 512) == 1024
    assert pick_bucket([], 512) is None
    t = _table([(CFG_A, 1024), (CFG_B, 4096)], device=H100)
    assert t.lookup(H100, DType.BF16, 128, 3000) == CFG_A
    assert t.lookup(H100, DType.BF16, 128, 9000) == CFG_B
    assert t.lookup(H100, DType.FP16, 128, 4096) is None  # no entry for that dtype


def test_device_matching():
    exact = _table([(CFG_A, 512)], device=H100)
    assert exact.matches(H100) and exact.matches(H100.lower()) and not exact.matches("NVIDIA H100 PCIe")
    family = _table([(CFG_A, 512)], match="H100")
    assert family.matches(H100) and family.matches("NVIDIA H100 PCIe")
    assert not family.matches(A100) and not family.matches("NVIDIA H1000") and not family.matches(None)
    assert family.lookup(A100, DType.BF16, 128, 512) is None


def test_also_match_serves_other_models_after_their_own_tables(isolated_tables, tmp_path):
    shared = _table([(CFG_A, 512)], match="H100")
    shared.also_match = ("H200",)
    assert shared.match_strength(H100) == 2 and shared.match_strength("NVIDIA H200") == 1
    assert shared.matches("NVIDIA H200 NVL") and not shared.matches("NVIDIA H20") and not shared.matches(A100)
    again = TuningTable.from_dict(json.loads(json.dumps(shared.to_dict())))
    assert again.also_match == ("H200",) and again.lookup("NVIDIA H200", DType.BF16, 128, 4096) == CFG_A
    assert "also_match" not in _table([(CFG_A, 512)], match="H100").to_dict()  # older tables read the same
    for bad in ("H200", [""], [7]):
        with pytest.raises(TuningTableError, match="also_match"):
            TuningTable.from_dict({**shared.to_dict(), "also_match": bad})
    # the H200 takes the H100 table, until a table of its own is shipped: that one comes first
    shared.save(isolated_tables.shipped / "default_h100.json")
    assert tuning.explain_choice(DType.BF16, 128, 4096, 4096, "NVIDIA H200")[0] == CFG_A
    _table([(CFG_B, 512)], match="H200").save(isolated_tables.shipped / "default_h200.json")
    tuning.clear_caches()
    assert tuning.explain_choice(DType.BF16, 128, 4096, 4096, "NVIDIA H200") == (
        CFG_B, f"default table {isolated_tables.shipped / 'default_h200.json'}")
    assert tuning.explain_choice(DType.BF16, 128, 4096, 4096, H100)[0] == CFG_A


def test_fallback_arch_serves_unnamed_models_of_that_arch_last(isolated_tables):
    shared = _table([(CFG_A, 512), (CFG_B, 4096)], match="H100")
    shared.fallback_arch = "sm_90"
    assert shared.serves_arch("sm_90") and not shared.serves_arch("sm_80") and not shared.serves_arch(None)
    again = TuningTable.from_dict(json.loads(json.dumps(shared.to_dict())))
    assert again.fallback_arch == "sm_90"
    assert "fallback_arch" not in _table([(CFG_A, 512)], match="H100").to_dict()  # older tables read the same
    for bad in (90, "90", "SM_90", "sm_9", ""):
        with pytest.raises(TuningTableError, match="fallback_arch"):
            TuningTable.from_dict({**shared.to_dict(), "fallback_arch": bad})
    with pytest.raises(TuningTableError, match="fallback_arch"):
        TuningTable(match="H100", fallback_arch="hopper")
    path = shared.save(isolated_tables.shipped / "default_h100.json")
    # another sm_90 model no table names takes the table, seq-aware, and says why ...
    for name in ("NVIDIA H800", "NVIDIA GH200 480GB", "NVIDIA H20"):
        assert tuning.explain_choice(DType.BF16, 128, 8192, 8192, name, arch="sm_90") == (
            CFG_B, f"default table {path} (fallback for sm_90)")
        assert tuning.explain_choice(DType.BF16, 128, 512, 512, name, arch="sm_90")[0] == CFG_A
        # ... a model of another arch, or a call without the arch, does not ...
        assert tuning.explain_choice(DType.BF16, 128, 8192, 8192, name, arch="sm_89") == (None, "heuristic")
        assert tuning.explain_choice(DType.BF16, 128, 8192, 8192, name) == (None, "heuristic")
    assert tuning.explain_choice(DType.BF16, 128, 8192, 8192, None, arch="sm_90")[0] == CFG_B
    # ... the model's own table comes first, its user table before that, and a table that names the
    # model without the problem's row leaves it to the fallback
    own = _table([(DEFAULT, 512)], match="H800")
    own.save(isolated_tables.shipped / "default_h800.json")
    tuning.clear_caches()
    assert tuning.explain_choice(DType.BF16, 128, 8192, 8192, "NVIDIA H800", arch="sm_90") == (
        DEFAULT, f"default table {isolated_tables.shipped / 'default_h800.json'}")
    assert tuning.explain_choice(DType.FP16, 128, 8192, 8192, "NVIDIA H800", arch="sm_90") == (None, "heuristic")
    fp16 = config_sets.default_config(DType.FP16, 128)
    shared.set(fp16, 512)
    shared.save(path)
    tuning.clear_caches()
    assert tuning.explain_choice(DType.FP16, 128, 8192, 8192, "NVIDIA H800", arch="sm_90") == (
        fp16, f"default table {path} (fallback for sm_90)")
    user = tuning.user_table_path("NVIDIA H800")
    _table([(CFG_B, 512)], device="NVIDIA H800").save(user)
    tuning.clear_caches()
    assert tuning.explain_choice(DType.BF16, 128, 8192, 8192, "NVIDIA H800", arch="sm_90") == (
        CFG_B, f"user table {user}")
    # the H100 itself reads it as its own table, not as a fallback
    assert tuning.explain_choice(DType.BF16, 128, 8192, 8192, H100, arch="sm_90") == (CFG_B, f"default table {path}")


def test_tuned_config_passes_the_device_arch(isolated_tables, monkeypatch):
    shared = _table([(CFG_A, 512)], match="H100")
    shared.fallback_arch = "sm_90"
    shared.save(isolated_tables.shipped / "default_h100.json")
    monkeypatch.setattr(tuning, "device_name", lambda device: "NVIDIA H800")
    monkeypatch.setitem(tuning._device_archs, 0, "sm_90")
    monkeypatch.setitem(tuning._device_archs, 1, "sm_80")
    assert tuning.tuned_config(DType.BF16, 128, 4096, 4096, 0) == CFG_A
    assert tuning.tuned_config(DType.BF16, 128, 4096, 4096, 1) is None


def test_shipped_hopper_forward_table_is_the_sm90_fallback():
    from cupyflash.families.forward_sm90.config_sets import default_config

    from pathlib import Path

    # the file in the package (the autouse fixture points default_tables_dir elsewhere)
    table = TuningTable.load(Path(tuning.__file__).parent / "default_h100.forward_sm90.json")
    assert table.family == "forward_sm90" and table.fallback_arch == "sm_90" and table.match == "H100"
    # an unnamed Hopper model gets the table's seq-aware rows, not the seq-blind default
    cfg = table.lookup("NVIDIA H800", DType.BF16, 128, 512, False, "sm_90")
    assert cfg is not None and cfg == table.get(DType.BF16, 128, 512).config
    assert table.lookup("NVIDIA H800", DType.BF16, 128, 512) is None  # without the arch: not named
    assert {e.config for e in table.entries() if e.config.d_head == 128 and not e.causal
            and e.config.dtype is DType.BF16} != {default_config(DType.BF16, 128)}
    for name in ("NVIDIA A100-SXM4-80GB", "NVIDIA L40S"):
        assert table.lookup(name, DType.BF16, 128, 512, False, "sm_80") is None


@pytest.mark.parametrize("text", ["{not json", "[]", '{"schema": "other/1", "entries": []}',
                                  '{"schema": "cupyflash-tuning-table/1"}',
                                  '{"schema": "cupyflash-tuning-table/1", "entries": [{"dtype": "BF16"}]}'])
def test_malformed_tables_raise(tmp_path, text):
    p = tmp_path / "bad.json"
    p.write_text(text)
    with pytest.raises(TuningTableError):
        TuningTable.load(p)


def test_entry_must_match_its_config():
    data = _table([(CFG_A, 512)], device=H100).to_dict()
    data["entries"][0]["d_head"] = 64
    with pytest.raises(TuningTableError, match="does not match"):
        TuningTable.from_dict(data)


def test_names_and_paths(isolated_tables):
    assert tuning.device_slug(H100) == "nvidia-h100-80gb-hbm3"
    assert tuning.device_family(H100) == "H100"
    assert tuning.device_family(A100) == "A100"
    assert tuning.device_family("NVIDIA L40S") == "L40S"
    assert tuning.device_family("NVIDIA GeForce RTX 4090") is None
    assert tuning.user_table_path(H100) == isolated_tables.cache / "tuning" / "nvidia-h100-80gb-hbm3.json"
    assert tuning.default_table_path(H100).name == "default_h100.json"
    assert tuning.default_table_path("NVIDIA GeForce RTX 4090").name == "default_nvidia-geforce-rtx-4090.json"


# ----------------------------------------------------------------------------- lookup order
def test_precedence_user_then_default_then_heuristic(isolated_tables):
    _table([(CFG_A, 512)], match="H100").save(isolated_tables.shipped / "default_h100.json")
    cfg, source = tuning.explain_choice(DType.BF16, 128, 4096, 4096, H100)
    assert cfg == CFG_A and source.startswith("default table")
    _table([(CFG_B, 512)], device=H100).save(tuning.user_table_path(H100))
    tuning.clear_caches()
    cfg, source = tuning.explain_choice(DType.BF16, 128, 4096, 4096, H100)
    assert cfg == CFG_B and source.startswith("user table")
    # another GPU: neither table applies
    assert tuning.explain_choice(DType.BF16, 128, 4096, 4096, A100) == (None, "heuristic")
    assert tuning.explain_choice(DType.BF16, 128, 4096, 4096, None) == (None, "heuristic")
    # a dtype only the default table has falls through the user table
    fp16 = config_sets.default_config(DType.FP16, 128)
    _table([(CFG_A, 512), (fp16, 512)], match="H100").save(isolated_tables.shipped / "default_h100.json")
    tuning.clear_caches()
    assert tuning.explain_choice(DType.FP16, 128, 512, 512, H100)[0] == fp16


def test_a_tuned_config_serves_any_sequence_length(isolated_tables):
    # The kernel masks tails, so the table's pick holds for lengths that are not multiples of
    # its B_r/B_c (it used to fall through to the next table then).
    assert CFG_B.B_r == 128
    _table([(CFG_B, 512)], device=H100).save(tuning.user_table_path(H100))
    _table([(CFG_A, 512)], match="H100").save(isolated_tables.shipped / "default_h100.json")
    for seq_q, seq_k in ((192, 192), (1, 1), (1000, 3001), (3001, 7), (256, 256)):
        assert tuning.explain_choice(DType.BF16, 128, seq_q, seq_k, H100)[0] == CFG_B


def test_api_select_config_uses_tables(isolated_tables, monkeypatch):
    monkeypatch.setattr(tuning, "device_name", lambda device: {0: H100, 1: A100}.get(device))
    _table([(CFG_B, 512)], match="H100").save(isolated_tables.shipped / "default_h100.json")
    assert api._select_config(DType.BF16, 128, 1024, 1024, 0) == CFG_B
    assert api._select_config(DType.BF16, 128, 1024, 1024, 1) == DEFAULT  # heuristic on another GPU
    assert api.resolve_config("auto", DType.BF16, 128, 1024, 1024, 0) == CFG_B
    with pytest.raises(ValueError, match="d_head 80"):  # unsupported d_head keeps its clear error
        api._select_config(DType.BF16, 80, 1024, 1024, 0)


def test_corrupt_user_table_warns_once_and_falls_back(isolated_tables):
    path = tuning.user_table_path(H100)
    path.parent.mkdir(parents=True)
    path.write_text('{"schema": "cupyflash-tuning-table/1", "entries": [')  # truncated
    _table([(CFG_A, 512)], match="H100").save(isolated_tables.shipped / "default_h100.json")
    with pytest.warns(RuntimeWarning, match="ignoring tuning table"):
        assert tuning.explain_choice(DType.BF16, 128, 4096, 4096, H100)[0] == CFG_A
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the broken file is not re-read or re-reported per call
        assert tuning.explain_choice(DType.BF16, 128, 2048, 2048, H100)[0] == CFG_A
    (isolated_tables.shipped / "default_h100.json").write_bytes(b"\x00\xff garbage")
    tuning.clear_caches()
    with pytest.warns(RuntimeWarning):
        assert tuning.explain_choice(DType.BF16, 128, 4096, 4096, H100) == (None, "heuristic")


def test_lookup_is_cached_per_call(isolated_tables, monkeypatch):
    calls = []
    real = TuningTable.load

    def counting_load(path):
        calls.append(path)
        return real(path)

    monkeypatch.setattr(TuningTable, "load", staticmethod(counting_load))
    monkeypatch.setattr(tuning, "device_name", lambda device: H100)
    _table([(CFG_A, 512)], device=H100).save(tuning.user_table_path(H100))
    for _ in range(100):
        assert tuning.tuned_config(DType.BF16, 128, 4096, 4096, 0) == CFG_A
        tuning.tuned_config(DType.BF16, 128, 1024, 1024, 0)
    assert len(calls) == 1
    assert tuning.tuned_config.cache_info().hits >= 198


def test_shipped_default_table_is_valid_and_honest():
    """The packaged table loads; an unmeasured one says so and has no entries."""
    from pathlib import Path

    folder = Path(tuning.__file__).resolve().parent  # the real folder (the fixture patches the function)
    assert (folder / "default_h100.json").is_file()
    for path in sorted(folder.glob("default_*.json")):
        table = TuningTable.load(path)
        assert table.match or table.device
        if not len(table):
            assert "UNMEASURED" in (table.comment or "")
        else:
            assert table.meta.get("date") and table.meta.get("versions"), "a measured table records its run"
            assert table.meta.get("complete") is True, "the shipped table comes from a run that finished"


# ----------------------------------------------------------------------------- candidates
def test_candidate_order_is_deterministic():
    from cupyflash.autotune import candidate_configs

    first = candidate_configs(DType.BF16, 128)
    assert first == sorted(first) == candidate_configs(DType.BF16, 128)
    assert first == TUNE_BF16_128 and DEFAULT in first
    shuffled = list(config_sets.all_configs())
    np.random.default_rng(0).shuffle(shuffled)
    picked = candidate_configs(DType.FP16, 64, shuffled + shuffled[:10])
    assert picked == sorted(c for c in set(shuffled) if c.dtype is DType.FP16 and c.d_head == 64)


# ----------------------------------------------------------------------------- the autotune loop
def _fake_cupy():
    """numpy dressed as the parts of CuPy the tuner touches."""
    fake = types.ModuleType("cupy")
    for name in dir(np):
        if not name.startswith("__"):
            setattr(fake, name, getattr(np, name))
    fake.__version__ = "fake"
    fake.get_default_memory_pool = lambda: types.SimpleNamespace(free_all_blocks=lambda: None)
    props = {"name": H100.encode(), "l2CacheSize": 50 * 2**20}
    runtime = types.SimpleNamespace(getDevice=lambda: 0, getDeviceProperties=lambda d: props,
                                    driverGetVersion=lambda: 0, runtimeGetVersion=lambda: 0)
    fake.cuda = types.SimpleNamespace(runtime=runtime, Device=lambda d: contextlib.nullcontext())
    return fake


def _exact_attention(q, k, v, out, bad=False, causal=False):
    f = lambda x: x.astype(np.float32).transpose(0, 2, 1, 3)  # noqa: E731
    s = f(q) @ f(k).transpose(0, 1, 3, 2) / math.sqrt(q.shape[-1])
    if causal:  # square problems: the lower triangle
        s = np.where(np.triu(np.ones(s.shape[-2:], dtype=bool), 1), -np.inf, s)
    p = np.exp(s - s.max(-1, keepdims=True))
    o = (p / p.sum(-1, keepdims=True)) @ f(v)
    out[...] = o.transpose(0, 2, 1, 3).astype(out.dtype)
    if bad:
        out[:, -1] = 0  # a wrong last row: the spot check must catch it


def test_autotune_loop_picks_fastest_correct_and_writes_tables(isolated_tables, monkeypatch, capsys):
    import sys

    from cupyflash import autotune as _  # noqa: F401  (module loaded; the package attribute is the function)
    autotune_mod = sys.modules["cupyflash.autotune"]
    from cupyflash import device

    cands = TUNE_BF16_128[:6]
    fast, wrong, broken = cands[2], cands[0], cands[1]
    speed = {c: 1.0 + 0.1 * i for i, c in enumerate(cands)}  # fixture values, not measurements
    speed[fast], speed[wrong] = 0.5, 0.1                      # the wrong one would win if trusted
    launches = []

    def fake_forward(cfg, q, k, v, out=None, **kw):
        if cfg == broken:
            raise RuntimeError("launch failed")
        launches.append(cfg)
        _exact_attention(q, k, v, out, bad=cfg == wrong)

    def fake_time(run, n_sets, warmup, iters, sustain=0.0):
        run(0)
        return benchmarking.Timing(speed[launches[-1]], speed[launches[-1]], speed[launches[-1]], iters)

    real_grid = benchmarking.grid_shape
    from cupyflash.compiler import nvrtc_version

    nvrtc_version()  # loads NVRTC through the real CuPy before numpy stands in for it (cached)
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    monkeypatch.setattr(device, "require_gpu", lambda: None)
    monkeypatch.setattr(autotune_mod, "_compile_all", lambda configs, dev, stream, causal=False: {})
    monkeypatch.setattr(autotune_mod, "time_cupy", fake_time)
    monkeypatch.setattr(forward_tuning, "grid_shape", lambda s, d: real_grid(s, d, tokens=512, width=256))
    monkeypatch.setattr(api, "forward", fake_forward)
    monkeypatch.setattr(autotune_mod, "default_table_path",
                        lambda name, family=None: isolated_tables.shipped / "default_h100.json")

    fp16 = config_sets.default_config(DType.FP16, 128)  # from an earlier run split by dtype: kept
    earlier = _table([(fp16, 512)], match="H100")
    earlier.also_match = ("H200",)  # and the other models it serves
    earlier.fallback_arch = "sm_90"
    earlier.save(isolated_tables.shipped / "default_h100.json")
    table = autotune_mod.autotune([DType.BF16], [128], [128, 256], candidates=cands, iters=3, warmup=0,
                                  progress=False, write_default=True)
    out = capsys.readouterr()
    assert [(e.seq, e.config) for e in table.entries()] == [(128, fast), (256, fast)]
    assert table.get(DType.BF16, 128, 256).info["correct"] == 4
    assert "relative L2 error" in out.err and "launch failed" in out.err
    assert "tuning table for NVIDIA H100 80GB HBM3" in out.out
    # the wrong config was checked once (first bucket) and never timed again
    assert launches.count(wrong) == 1
    user = TuningTable.load(tuning.user_table_path(H100))
    assert user.device == H100 and user.lookup(H100, DType.BF16, 128, 200) == fast
    shipped = TuningTable.load(isolated_tables.shipped / "default_h100.json")
    assert shipped.match == "H100" and len(shipped) == 3 and shipped.meta["versions"]["cupyflash"]
    assert shipped.also_match == ("H200",) and shipped.fallback_arch == "sm_90"
    assert shipped.lookup(H100, DType.FP16, 128, 512) == fp16 and shipped.lookup(H100, DType.BF16, 128, 128) == fast
    assert shipped.meta["complete"] is True and shipped.meta["missing"] == []
    # forward(cfg=None) sees the new table at once
    monkeypatch.setattr(tuning, "device_name", lambda d: H100)
    assert tuning.tuned_config(DType.BF16, 128, 256, 256, 0) == fast


@pytest.fixture
def fake_tuner(isolated_tables, monkeypatch):
    """The autotune module with numpy for CuPy, an exact numpy forward (causal-aware), no
    compiles, and a timer that asks `ns.time_of(cfg)` for each timing (fixtures, not
    measurements). ns.launches logs (cfg, causal); ns.compiled the causal flag of each compile."""
    import sys

    from cupyflash import autotune as _  # noqa: F401
    from cupyflash import device
    from cupyflash.compiler import nvrtc_version

    ns = types.SimpleNamespace(mod=sys.modules["cupyflash.autotune"], launches=[], compiled=[], time_of=None,
                               sustains=[])

    def fake_forward(cfg, q, k, v, out=None, causal=False, **kw):
        ns.launches.append((cfg, causal))
        _exact_attention(q, k, v, out, causal=causal)

    def fake_time(run, n_sets, warmup, iters, sustain=0.0):
        run(0)
        ns.sustains.append((ns.launches[-1][0], sustain))
        t = ns.time_of(ns.launches[-1][0])
        return benchmarking.Timing(t, t, t, iters)

    real_grid = benchmarking.grid_shape
    nvrtc_version()  # loads NVRTC through the real CuPy before numpy stands in for it (cached)
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    monkeypatch.setattr(device, "require_gpu", lambda: None)
    monkeypatch.setattr(ns.mod, "_compile_all",
                        lambda configs, dev, stream, causal=False: ns.compiled.append(causal) or {})
    monkeypatch.setattr(ns.mod, "time_cupy", fake_time)
    monkeypatch.setattr(forward_tuning, "grid_shape", lambda s, d: real_grid(s, d, tokens=512, width=256))
    monkeypatch.setattr(api, "forward", fake_forward)
    monkeypatch.setattr(ns.mod, "default_table_path", lambda name, family=None: isolated_tables.shipped / "default_h100.json")
    return ns


def test_autotune_causal_fills_the_causal_rows(isolated_tables, fake_tuner, monkeypatch):
    """--causal times causally masked problems (checked against a causal reference) and stores
    causal rows beside the non-causal ones; forward(causal=True) then picks from them."""
    cands = TUNE_BF16_128[:4]
    speed = {c: 1.0 + 0.1 * i for i, c in enumerate(cands)}  # fixture values, not measurements
    speed[cands[3]] = 0.5
    fake_tuner.time_of = speed.__getitem__
    _table([(cands[0], 128)], match="H100").save(isolated_tables.shipped / "default_h100.json")

    fake_tuner.mod.autotune([DType.BF16], [128], [128], candidates=cands, iters=3, warmup=0,
                            progress=False, write_default=True, causal=True)
    assert fake_tuner.compiled == [True] and {c for _, c in fake_tuner.launches} == {True}
    shipped = TuningTable.load(isolated_tables.shipped / "default_h100.json")
    assert [(e.seq, e.causal, e.config) for e in shipped.entries()] == [(128, False, cands[0]), (128, True, cands[3])]
    assert shipped.meta["causal"] is True
    monkeypatch.setattr(tuning, "device_name", lambda d: H100)
    assert tuning.tuned_config(DType.BF16, 128, 128, 128, 0, True) == cands[3]
    assert tuning.tuned_config(DType.BF16, 128, 128, 128, 0) == cands[0]
    assert api._select_config(DType.BF16, 128, 128, 128, 0, True) == cands[3]


def test_two_sweeps_cancel_clock_drift(fake_tuner):
    """The GPU slows down steadily while the first pass runs: timed once in order, the first
    candidates would look fastest and fill the finals. The reversed second sweep cancels that,
    so the truly fastest one is a finalist and wins (times are fixtures, not measurements)."""
    cands = TUNE_BF16_128[:6]
    true_ms = {c: 1.0 for c in cands}
    true_ms[cands[5]] = 0.9  # fastest, but timed last in the first sweep
    calls = []

    def drifting(cfg):
        calls.append(cfg)
        return true_ms[cfg] * (1 + 0.05 * len(calls))  # each timing 5% slower than the one before

    fake_tuner.time_of = drifting
    table = fake_tuner.mod.autotune([DType.BF16], [128], [128], candidates=cands, iters=4, warmup=0,
                                    progress=False, finalists=2)
    assert table.get(DType.BF16, 128, 128).config == cands[5]
    # checked once each, then: sweep in order, sweep reversed, finals
    assert calls[:6] == cands and calls[6:12] == cands[::-1]


def test_autotune_cli_without_gpu_exits_2(monkeypatch, capsys):
    import sys

    from cupyflash import device

    autotune_mod = sys.modules["cupyflash.autotune"]
    monkeypatch.setattr(device, "has_gpu", lambda: False)
    assert autotune_mod.main(["--dtypes", "bf16", "--d-heads", "128"]) == 2
    assert "no CUDA GPU found" in capsys.readouterr().err
    assert autotune_mod.main(["--dtypes", "int8"]) == 2
    assert autotune_mod.main(["--seqs", "1k,x"]) == 2


def test_spot_check_catches_errors_with_numpy_standing_in(monkeypatch):
    """benchmarking's reference check, run through numpy: exact output passes, a NaN or a wrong
    row fails."""
    import sys

    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    for dtype in DType:
        q, k, v = (benchmarking.random_inputs((2, 64, 2, 64), dtype, seed=i) for i in range(3))
        out = np.empty_like(q)
        benchmarking.poison(out, dtype)
        assert benchmarking.spot_check_rel_l2(q, k, v, out, dtype) == math.inf
        _exact_attention(q, k, v, out)
        assert benchmarking.spot_check_rel_l2(q, k, v, out, dtype) < benchmarking.REL_L2_TOLERANCE[dtype] / 4
        out[1, 5, 1] = out[1, 6, 1]
        assert benchmarking.spot_check_rel_l2(q, k, v, out, dtype) > benchmarking.REL_L2_TOLERANCE[dtype]


def test_grid_helpers():
    assert benchmarking.grid_shape(512, 128).shape == (32, 512, 16, 128)
    assert benchmarking.grid_shape(16384, 64).shape == (1, 16384, 32, 64)
    assert benchmarking.grid_shape(4096, 96).shape == (4, 4096, 21, 96)  # the nearest head count
    with pytest.raises(ValueError):
        benchmarking.grid_shape(3000, 128)
    assert benchmarking.attention_flops(1, 16, 4096, 4096, 128) == 4 * 16 * 4096 * 4096 * 128
    assert benchmarking.rotation_sets(256 * 2**20, 50 * 2**20) == 1
    assert benchmarking.rotation_sets(4 * 2**20, 50 * 2**20) == 38
    assert benchmarking.rotation_sets(4 * 2**20, None) == 38
    rows = benchmarking.spot_rows(16384)
    assert rows[0] == 0 and rows[-1] == 16383 and len(rows) == 256 and np.all(np.diff(rows) > 0)
    assert benchmarking.parse_ints("512,1k,16k") == (512, 1024, 16384)
    assert benchmarking.parse_dtypes("bf16, FP16") == (DType.BF16, DType.FP16)
    with pytest.raises(RuntimeError):
        benchmarking.summarize([1.0, float("nan")])
    assert benchmarking.summarize([3.0, 1.0, 2.0]).median_ms == 2.0


def test_final_round_picks_the_lowest_median_of_interleaved_rounds(monkeypatch):
    """Finalists are re-timed in alternating order over FINAL_ROUNDS rounds; one lucky round does
    not win (round times below are fixtures, not measurements)."""
    import sys

    from cupyflash import autotune as _  # noqa: F401
    autotune_mod = sys.modules["cupyflash.autotune"]
    a, b, c = TUNE_BF16_128[:3]
    rounds = {a: [0.80, 1.20, 1.20, 1.20, 1.20],   # one fast round, slower in the others
              b: [1.00, 1.00, 1.00, 1.00, 1.00],
              c: [RuntimeError("launch failed")]}
    order = []

    def fake_time(run, n_sets, warmup, iters, sustain=0.0):
        cfg = run.__defaults__[0]  # the lambda binds the finalist's config as a default
        order.append(cfg)
        t = rounds[cfg].pop(0)
        if isinstance(t, Exception):
            raise t
        return benchmarking.Timing(t, t, t, iters)

    monkeypatch.setattr(autotune_mod, "time_cupy", fake_time)
    first = benchmarking.Timing(0.5, 0.5, 0.5, 1)
    finals = [autotune_mod._Result(cfg, i, timing=first) for i, cfg in enumerate((a, b, c))]
    problem = types.SimpleNamespace(n_sets=1, timed_call=lambda cfg: (lambda i, c=cfg: None))
    winner = autotune_mod._final_round(finals, problem, warmup=0, iters=3)
    assert winner.cfg == b and winner.timing.median_ms == 1.00
    assert finals[0].timing.median_ms == 1.20  # reported: the round with the median median
    assert finals[2].timing is None and "launch failed" in finals[2].error
    assert order[:3] == [a, b, c] and order[3:5] == [b, a]  # alternating; c dropped after failing
    assert autotune_mod.FINAL_ROUNDS == 5 and order.count(a) == 5


@pytest.mark.parametrize("knob_twins", [True, False])
def test_winner_meets_its_knob_twins(isolated_tables, fake_tuner, monkeypatch, capsys, knob_twins):
    """After the finals, the winner is timed against the family's knob twins of it (each checked
    against the reference first): a faster correct twin takes the row, a wrong one is reported and
    never timed, a tie keeps the winner; knob_twins=False leaves the winner alone. Times are
    fixtures, not measurements."""
    from cupyflash.families import get_family

    cands, outside = TUNE_BF16_128[:3], TUNE_BF16_128[3:6]
    faster, wrong, tied = outside
    speed = {cands[0]: 1.0, cands[1]: 0.9, cands[2]: 1.1, faster: 0.7, wrong: 0.1, tied: 0.9}
    fake_tuner.time_of = speed.__getitem__
    asked = []
    family = get_family("forward_sm80")
    monkeypatch.setattr(family, "knob_twins", lambda cfg, causal: asked.append((cfg, causal)) or list(outside))
    real_forward = api.forward

    def forward_with_a_wrong_twin(cfg, q, k, v, out=None, causal=False, **kw):
        real_forward(cfg, q, k, v, out=out, causal=causal, **kw)
        if cfg == wrong:
            out[:, -1] = 0  # the reference check must catch it

    monkeypatch.setattr(api, "forward", forward_with_a_wrong_twin)
    table = fake_tuner.mod.autotune([DType.BF16], [128], [128, 256], candidates=cands, iters=3, warmup=0,
                                    progress=False, knob_twins=knob_twins)
    err = capsys.readouterr().err
    picked = [e.config for e in table.entries()]
    timed = [cfg for cfg, _ in fake_tuner.launches]
    if knob_twins:  # the two fastest finalists' twins, per bucket
        assert picked == [faster, faster] and asked == [(cands[1], False), (cands[0], False)] * 2
        assert table.get(DType.BF16, 128, 128).info["twin_of"] == cands[1].short_form()
        assert timed.count(wrong) == 1 and "relative L2 error" in err  # checked once, then excluded
    else:
        assert picked == [cands[1], cands[1]] and asked == [] and not set(outside) & set(timed)
        assert "twin_of" not in table.get(DType.BF16, 128, 128).info


def test_tied_knob_twin_keeps_the_winner(monkeypatch):
    """A twin exactly as fast as the winner does not replace it (twins rank after every
    candidate)."""
    import sys

    from cupyflash import autotune as _  # noqa: F401
    autotune_mod = sys.modules["cupyflash.autotune"]
    a, b = TUNE_BF16_128[:2]
    monkeypatch.setattr(autotune_mod, "time_cupy",
                        lambda run, n_sets, warmup, iters, sustain=0.0: benchmarking.Timing(1, 1, 1, 1))
    problem = types.SimpleNamespace(n_sets=1, timed_call=lambda cfg: (lambda i: None),
                                    skip_reason=lambda cfg: None, check=lambda cfg: None)
    winner = autotune_mod._Result(a, 7, timing=benchmarking.Timing(1, 1, 1, 1))
    assert autotune_mod._knob_round(winner, [b], {}, problem, warmup=0, iters=2, first_index=10).cfg == a
    assert autotune_mod._knob_round(winner, [], {}, problem, warmup=0, iters=2, first_index=10) is winner


def test_sustain_loads_the_gpu_before_the_deciding_rounds_only(isolated_tables, fake_tuner, monkeypatch):
    """sustain > 0: every timing of the final and knob rounds runs after that much load (the
    configs that decide the row meet at the power-capped clock); the sweeps, which only choose
    the finalists, run without it; the table's meta records it. Times are fixtures."""
    from cupyflash.families import get_family

    cands, twin = TUNE_BF16_128[:4], TUNE_BF16_128[4]
    speed = {c: 1.0 + 0.1 * i for i, c in enumerate(cands)}
    speed[twin] = 0.5
    fake_tuner.time_of = speed.__getitem__
    monkeypatch.setattr(get_family("forward_sm80"), "knob_twins", lambda cfg, causal: [twin])
    table = fake_tuner.mod.autotune([DType.BF16], [128], [128], candidates=cands, iters=4, warmup=0,
                                    progress=False, finalists=2, sustain=0.25)
    assert table.get(DType.BF16, 128, 128).config == twin and table.meta["sustain"] == 0.25
    sweeps, rest = fake_tuner.sustains[:2 * len(cands)], fake_tuner.sustains[2 * len(cands):]
    assert {s for _, s in sweeps} == {0.0}
    finals = [(c, s) for c, s in rest if s]
    rounds = fake_tuner.mod.FINAL_ROUNDS
    # the two finalists in the final rounds, then the winner and its twin in the knob round
    assert len(finals) == 2 * rounds + 2 * rounds and {c for c, _ in finals} == {cands[0], cands[1], twin}
    assert [c for c, s in rest if not s] == [twin]  # the twin's first (screening) timing, unloaded
    # the heuristic's figure, reported beside the winner's, comes from the same loaded regime
    heuristic = config_sets.default_config(DType.BF16, 128)
    speed[heuristic] = 3.0  # never a finalist
    fake_tuner.sustains.clear()
    table = fake_tuner.mod.autotune([DType.BF16], [128], [128], candidates=cands + [heuristic], iters=4, warmup=0,
                                    progress=False, finalists=2, sustain=0.25)
    assert fake_tuner.sustains[-1] == (heuristic, 0.25)
    assert table.get(DType.BF16, 128, 128).info["heuristic_tflops"] is not None
    for bad in (-1.0, float("nan"), "long"):
        with pytest.raises(ValueError, match="sustain"):
            fake_tuner.mod.autotune([DType.BF16], [128], [128], candidates=cands, progress=False, sustain=bad)


def test_a_runner_up_twin_can_take_the_row(isolated_tables, fake_tuner, monkeypatch):
    """The knob twins of the second-fastest finalist are timed too (twin_finalists=2, the
    default): when one of them beats the winner it takes the row and `twin_of` names the finalist
    it was made from; twin_finalists=1 times only the winner's. Times are fixtures."""
    from cupyflash.families import get_family

    cands, (winners_twin, runner_ups_twin) = TUNE_BF16_128[:3], TUNE_BF16_128[3:5]
    speed = {cands[0]: 1.0, cands[1]: 0.9, cands[2]: 1.2, winners_twin: 0.95, runner_ups_twin: 0.6}
    fake_tuner.time_of = speed.__getitem__
    made = {cands[1]: [winners_twin], cands[0]: [runner_ups_twin], cands[2]: []}
    monkeypatch.setattr(get_family("forward_sm80"), "knob_twins", lambda cfg, causal: made[cfg])
    table = fake_tuner.mod.autotune([DType.BF16], [128], [128], candidates=cands, iters=3, warmup=0,
                                    progress=False)
    row = table.get(DType.BF16, 128, 128)
    assert row.config == runner_ups_twin and row.info["twin_of"] == cands[0].short_form()
    assert table.meta["twin_finalists"] == 2
    table = fake_tuner.mod.autotune([DType.BF16], [128], [128], candidates=cands, iters=3, warmup=0,
                                    progress=False, twin_finalists=1)
    assert table.get(DType.BF16, 128, 128).config == cands[1]  # its own twin is slower
    with pytest.raises(ValueError, match="twin_finalists"):
        fake_tuner.mod.autotune([DType.BF16], [128], [128], candidates=cands, progress=False, twin_finalists=0)
