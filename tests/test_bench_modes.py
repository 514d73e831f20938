"""scripts/bench.py's decode, varlen and backward modes without a GPU: argument parsing, the
varlen FLOP count, the float64 references (on the CPU, when torch is importable), the check-then-
time record and the report formatting.

The records fed to the formatters are synthetic fixtures that exercise the layout; they are not
measurements.
"""
from __future__ import annotations

import itertools
import json
import math
import sys
import types
from pathlib import Path

import pytest

from cupyflash.device import has_gpu

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import bench  # noqa: E402
import bench_impls  # noqa: E402
import bench_mode_backward  # noqa: E402
import bench_mode_common as common  # noqa: E402
import bench_mode_decode  # noqa: E402
import bench_mode_varlen as varlen  # noqa: E402

no_gpu = pytest.mark.skipif(has_gpu(), reason="with a GPU this would run the benchmark")


# ---------------------------------------------------------------------------- arguments
def test_split_mode_peels_mode_off_and_defaults_to_forward():
    assert bench.split_mode(["--mode", "decode", "--rows", "0,1"]) == ("decode", ["--rows", "0,1"])
    assert bench.split_mode(["--mode=varlen"]) == ("varlen", [])
    assert bench.split_mode(["--seqs", "1k"]) == ("forward", ["--seqs", "1k"])
    with pytest.raises(SystemExit):
        bench.split_mode(["--mode", "prefill"])


def test_forward_help_lists_the_modes():
    text = bench.build_parser().format_help()
    assert "--mode" in text and "decode" in text and "varlen" in text and "backward" in text


@pytest.mark.parametrize("mode", ["varlen", "decode", "backward"])
def test_mode_help_exits_0(mode, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--mode", mode, "--help"])
    assert exc.value.code == 0
    assert "--json" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [
    ["--mode", "varlen", "--d-heads", "80"], ["--mode", "varlen", "--impls", "triton"],
    ["--mode", "varlen", "--total-tokens", "0"], ["--mode", "varlen", "--dtypes", "int8"],
    ["--mode", "varlen", "--iters", "0"],
    ["--mode", "decode", "--rows", "12"], ["--mode", "decode", "--rows", "x"], ["--mode", "decode", "--d-heads", "32"],
    ["--mode", "decode", "--samples", "0"], ["--mode", "decode", "--rounds", "0"],
    ["--mode", "backward", "--d-heads", "80"], ["--mode", "backward", "--seqs", "0"],
    ["--mode", "backward", "--reps", "0"], ["--mode", "backward", "--impls", "cupyflash,nope"],
    ["--mode", "backward", "--sm90-config", "backward_sm90(BF16, 128)"],
])
def test_bad_mode_arguments_exit_2(argv, capsys):
    assert bench.main(argv) == 2
    assert "error" in capsys.readouterr().err


@no_gpu
@pytest.mark.parametrize("mode", ["varlen", "decode", "backward"])
def test_modes_without_gpu_exit_2(mode, tmp_path, capsys):
    assert bench.main(["--mode", mode, "--json", str(tmp_path / "r.json")]) == 2
    assert "no CUDA GPU found" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_decode_row_selection():
    rows = bench_mode_decode.select_rows("0,5", "")
    assert rows == [bench_mode_decode.bd.TABLE_ROWS[0], bench_mode_decode.bd.TABLE_ROWS[5]]
    assert all(r[0] == 64 for r in bench_mode_decode.select_rows("", "64"))
    assert len(bench_mode_decode.select_rows("", "")) == len(bench_mode_decode.bd.TABLE_ROWS)


# ---------------------------------------------------------------------------- varlen batch and FLOPs
def _pairs_by_enumeration(lq: int, lk: int, causal: bool) -> int:
    return sum(1 for i in range(lq) for j in range(lk) if not causal or j <= i + lk - lq)


def test_visible_pairs_known_cases():
    assert varlen.visible_pairs(3, 3, causal=True) == 6        # 1 + 2 + 3
    assert varlen.visible_pairs(2, 5, causal=True) == 4 + 5    # the last 2 query rows of a 5x5 triangle
    assert varlen.visible_pairs(5, 2, causal=True) == 0 + 0 + 0 + 1 + 2  # 3 rows see no key
    assert varlen.visible_pairs(4, 7, causal=False) == 28
    assert varlen.visible_pairs(0, 7, causal=True) == 0 and varlen.visible_pairs(7, 0, causal=True) == 0


def test_visible_pairs_match_enumeration():
    for lq, lk in itertools.product(range(0, 9), repeat=2):
        for causal in (False, True):
            assert varlen.visible_pairs(lq, lk, causal) == _pairs_by_enumeration(lq, lk, causal), (lq, lk, causal)


def test_varlen_flops_sum_over_sequences():
    assert varlen.varlen_flops([3, 5], [3, 5], 16, 128, causal=False) == 4 * (9 + 25) * 16 * 128
    assert varlen.varlen_flops([3, 5], [3, 5], 16, 128, causal=True) == 4 * (6 + 15) * 16 * 128
    assert varlen.varlen_flops([2], [5], 1, 64, causal=True) == 4 * 9 * 64
    with pytest.raises(ValueError):
        varlen.varlen_flops([1, 2], [1], 1, 64, causal=False)


def test_square_causal_flops_are_a_bit_over_half():
    full = varlen.varlen_flops([4096], [4096], 16, 128, causal=False)
    causal = varlen.varlen_flops([4096], [4096], 16, 128, causal=True)
    assert causal == full * (4096 + 1) / (2 * 4096)


def test_drawn_lengths_are_fixed_by_the_seed_and_sum_to_the_total():
    a = varlen.draw_lengths(32768, 8192, seed=0)
    assert sum(a) == 32768 and all(1 <= n <= 8192 for n in a)
    assert a == varlen.draw_lengths(32768, 8192, seed=0)
    assert a != varlen.draw_lengths(32768, 8192, seed=1)
    assert varlen.draw_lengths(5, 8192, seed=0) == [5]  # the first draw cut to fit
    assert varlen.cu_seqlens([3, 0, 2]) == [0, 3, 3, 5]
    with pytest.raises(ValueError):
        varlen.draw_lengths(0, 10, seed=0)


# ---------------------------------------------------------------------------- check then time
def test_check_then_time_refuses_before_timing():
    timed = []
    rec = common.check_then_time("cupyflash", lambda: 0.5, lambda: timed.append(1) or 1.0, 1e-2)
    assert rec["status"] == "refused" and "0.5" in rec["reason"] and not timed
    rec = common.check_then_time("cupyflash", lambda: math.inf, lambda: 1.0, 1e-2)
    assert rec["status"] == "refused" and "NaN" in rec["reason"]


def test_check_then_time_ok_skip_and_error():
    assert common.check_then_time("x", lambda: 1e-3, lambda: 12.5, 1e-2) | {} == \
        {"impl": "x", "status": "ok", "reason": None, "rel_l2": 1e-3, "us": 12.5}

    def skip():
        raise common.Skip("not installed")

    def boom():
        raise RuntimeError("bad launch\nsecond line")

    assert common.check_then_time("x", skip, lambda: 1.0, 1e-2)["status"] == "skipped"
    rec = common.check_then_time("x", boom, lambda: 1.0, 1e-2)
    assert rec["status"] == "error" and rec["reason"] == "RuntimeError: bad launch"


def test_collect_failures_counts_only_cupyflash():
    recs = [{"impl": "cupyflash", "status": "refused", "reason": "r", "point": "p"},
            {"impl": "cupyflash_paged16", "status": "ok", "reason": None},
            {"impl": "sdpa_cudnn", "status": "error", "reason": "e"}]
    assert common.collect_failures(recs) == ["p cupyflash: refused: r"]


def test_verdict_and_table():
    assert common.verdict(1.1, 1.0) == "ok" and common.verdict(0.9, 1.0) == "MISS"
    assert common.verdict(0.9, 1.0, at_most=True) == "ok" and common.verdict(None, 1.0) == "-"
    table = common.format_table(["a", "bb"], [["1", "22222"]]).splitlines()
    assert table[0].startswith("| ") and len(table) == 3 and len(set(map(len, table))) == 1


# ---------------------------------------------------------------------------- report formatting
def _table_rows(text: str) -> list[list[str]]:
    """The data rows of the Markdown table in `text`, as lists of stripped cells."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("|") and not line.startswith("|-")]
    return rows[1:]


def _vrec(impl, dtype, d, causal, tflops=None, status="ok", reason=None):
    return {"impl": impl, "dtype": dtype, "d_head": d, "causal": causal, "status": status, "reason": reason,
            "tflops": tflops, "point": f"{dtype} d{d} causal={int(causal)}"}


def test_varlen_report_ratios_and_targets():
    recs = [_vrec("cupyflash", "bf16", 128, False, 400.0), _vrec("sdpa_flash", "bf16", 128, False, 320.0),
            _vrec("sdpa_cudnn", "bf16", 128, False, status="skipped", reason="no jagged"),
            _vrec("fa3", "bf16", 128, False, 500.0),
            _vrec("cupyflash", "bf16", 64, True, status="refused", reason="relative L2 error 0.5 > 0.01"),
            _vrec("sdpa_flash", "bf16", 64, True, 150.0)]
    text = varlen.format_report({"records": recs, "lengths": [3, 5], "seed": 0, "heads": 16, "iters": 30})
    row128, row64 = _table_rows(text)
    assert row128[:3] == ["bf16", "128", "no"] and row128[3:7] == ["400.0", "320.0", "SKIPPED", "500.0"]
    assert row128[7:] == ["1.25x", "ok", "0.80x", "MISS"]
    assert row64[:4] == ["bf16", "64", "yes", "REFUSED"] and row64[7:] == ["-", "-", "-", "-"]
    assert "not reported:" in text and "no jagged" in text and "issue 10" in text


def _drec(impl, us, status="ok", keys=8192, batch=1, d=128, seq_q=1, causal=False):
    kv = 2 * batch * keys * 8 * d * 2
    return {"impl": impl, "us": us if status == "ok" else None, "status": status, "reason": None if status == "ok"
            else "fixture", "dtype": "bf16", "d_head": d, "batch": batch, "seq_q": seq_q, "keys": keys,
            "causal": causal, "kv_bytes": kv, "limit_us": kv / 3.0e12 * 1e6, "point": "p"}


def test_decode_report_targets(tmp_path):
    big = dict(keys=4096, batch=32)  # 536 MB of K/V: the bandwidth target applies
    recs = [_drec("cupyflash", 200.0, **big), _drec("cupyflash_paged16", 230.0, **big),
            _drec("sdpa_flash", 215.0, **big), _drec("sdpa_cudnn", 191.0, **big), _drec("fa3", 197.0, **big),
            _drec("fa3_paged16", 194.0, **big),
            _drec("cupyflash", 20.0), _drec("cupyflash_paged16", 20.5), _drec("sdpa_flash", 34.0),
            _drec("sdpa_cudnn", 27.0), _drec("fa3", 0, status="skipped"), _drec("fa3_paged16", 0, status="skipped")]
    summary = bench_mode_decode.row_summary(recs)
    assert summary[0]["vs_best_peer"] == pytest.approx(200 / 191) and summary[0]["bandwidth_target"]
    assert summary[0]["paged_over_contig"] == pytest.approx(1.15)
    assert summary[1]["vs_best_peer"] == pytest.approx(20 / 27) and not summary[1]["bandwidth_target"]
    text = bench_mode_decode.format_report(recs, {})
    big_row, small_row = _table_rows(text)
    assert big_row[-4:] == ["179.0", "1.05 MISS", "89% ok", "1.15 MISS"]
    assert small_row[-3:] == ["0.74 ok", "56% (<64 MiB)", "1.02 ok"] and small_row[9] == "SKIPPED"
    why = bench_mode_decode.plot(summary, tmp_path / "d.png", "fixture")
    assert why is None or why.startswith("matplotlib is not importable")


def test_backward_report_targets():
    def rec(impl, tflops, seq=4096, causal=False):
        return {"impl": impl, "tflops": tflops, "status": "ok", "reason": None, "dtype": "bf16", "d_head": 128,
                "seq": seq, "causal": causal, "point": "p"}

    text = bench_mode_backward.format_report([rec("cupyflash", 520.0), rec("backward_sm80", 330.0),
                                              rec("backward_sm90", 520.0), rec("sdpa_flash", 300.0),
                                              rec("sdpa_cudnn", 500.0), rec("fa3", 650.0),
                                              rec("backward_sm80", 200.0, seq=512),
                                              rec("sdpa_flash", 250.0, seq=512)])
    at_4k, at_512 = _table_rows(text)
    assert at_4k[4:] == ["520", "330", "520", "300", "500", "650", "1.10x", "ok>=1.00", "1.04x", "0.80x"]
    assert at_512[4:] == ["-", "200", "-", "250", "-", "-", "0.80x", "-", "-", "-"]  # no target below S = 1k
    assert bench_mode_backward.target_flash(1024) == 1.0 and bench_mode_backward.target_flash(512) is None
    calls = []
    timers = {n: (lambda n=n: calls.append(n) or {"a": 1.0, "b": 2.0}[n] + len(calls)) for n in ("a", "b")}
    samples = bench_impls.timed_rounds({"a": 0.5, "b": 0.25}, timers, 3)
    assert calls == ["b", "a", "a", "b"]  # round 2 reversed, round 3 in order
    assert samples == {"a": [0.5, 3.0, 4.0], "b": [0.25, 3.0, 6.0]}
    assert bench_impls.timed_rounds({"a": 0.5}, {"a": timers["a"]}, 1) == {"a": [0.5]}
    assert bench_mode_backward.grid((1024, 32768)) == [(1024, 16), (32768, 1)]


# ---------------------------------------------------------------------------- references (CPU torch)
def test_decode_reference_matches_a_plain_softmax():
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    b, sq, h, hk, keys, d = 2, 3, 8, 2, 11, 16
    p = types.SimpleNamespace(q=[torch.randn(b, sq, h, d, generator=g)], k=[torch.randn(b, keys, hk, d, generator=g)],
                              v=[torch.randn(b, keys, hk, d, generator=g)], causal=True)
    got = bench_mode_decode.reference(torch, p, 1)
    for head in range(h):
        kk, vv = p.k[0][1, :, head // (h // hk)].double(), p.v[0][1, :, head // (h // hk)].double()
        s = p.q[0][1, :, head].double() @ kk.T / math.sqrt(d)
        mask = torch.arange(keys)[None, :] > torch.arange(sq)[:, None] + keys - sq  # bottom-right
        want = torch.softmax(s.masked_fill(mask, -math.inf), dim=-1) @ vv
        assert torch.allclose(got[:, head], want, atol=1e-12)
    refs = {1: got}
    out = torch.zeros(b, sq, h, d)
    out[1] = got.float()
    assert bench_mode_decode.rel_l2(torch, refs, out) < 1e-6
    out[1, 0, 0, 0] = math.nan
    assert bench_mode_decode.rel_l2(torch, refs, out) == math.inf


def test_backward_reference_matches_autograd():
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    b, s, h, d = 2, 7, 3, 8
    q, k, v, do = (torch.randn(b, s, h, d, generator=g, dtype=torch.float64) for _ in range(4))
    for causal in (False, True):
        qt, kt, vt = (x.transpose(1, 2).clone().requires_grad_() for x in (q, k, v))
        o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        want = torch.autograd.grad(o, (qt, kt, vt), do.transpose(1, 2))
        got = bench_mode_backward.reference_grads(torch, q, k, v, do, 1, 2, causal)
        for gg, ww in zip(got, want):
            assert torch.allclose(gg, ww[1, 2], atol=1e-10)
        refs = {(1, 2): got}
        grads = tuple(w.transpose(1, 2) for w in want)
        assert bench_mode_backward.grads_rel_l2(torch, refs, grads) < 1e-12


def test_varlen_per_sequence_error_takes_the_worst_sequence():
    torch = pytest.importorskip("torch")
    ref_a, ref_b = torch.ones(2, 4, dtype=torch.float64), torch.ones(1, 4, dtype=torch.float64)
    p = types.SimpleNamespace(refs=[(0, torch.tensor([0, 1]), 0, ref_a), (5, torch.tensor([0]), 0, ref_b)])
    out = torch.ones(6, 1, 4)
    out[5] *= 1.1  # 10% off on the second sequence only
    assert varlen.rel_l2_per_sequence(torch, p, out) == pytest.approx(0.1)
    out[0, 0, 0] = math.nan
    assert varlen.rel_l2_per_sequence(torch, p, out) == math.inf


# ---------------------------------------------------------------------------- orchestration
def test_varlen_main_with_fake_gpu_side(tmp_path, monkeypatch, capsys):
    """varlen.main end to end with the GPU side replaced by fixtures: a refused cupyflash makes
    the exit code 1, every record reaches the JSON, and the table is printed last."""
    cuda = types.SimpleNamespace(synchronize=lambda: None, empty_cache=lambda: None)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    host = types.SimpleNamespace(
        _no_gpu_reason=lambda: None, _import_jax=lambda peers: (None, "fixture: no jax"),
        _meta=lambda torch, jax: {"gpu": "Fake GPU", "date": "today", "versions": {"torch": "fake"}})
    monkeypatch.setattr(varlen, "make_problem", lambda torch, dtype, d, heads, lengths, causal, seed:
                        types.SimpleNamespace(dtype=dtype, d_head=d, heads=heads, causal=causal, lengths=lengths,
                                              flops=1e12))
    monkeypatch.setattr(varlen, "cupyflash_impl", lambda torch, p, w, i: (lambda: 0.5 if p.causal else 1e-3,
                                                                          lambda: 2000.0))
    monkeypatch.setattr(varlen, "sdpa_nested_impl", lambda torch, p, backend, w, i: (lambda: 1e-3, lambda: 2500.0))
    out_json = tmp_path / "v.json"
    rc = varlen.main(["--dtypes", "bf16", "--d-heads", "128", "--json", str(out_json), "--plot", ""], host=host)
    printed = capsys.readouterr()
    assert rc == 1 and "FAILURES" in printed.err
    data = json.loads(out_json.read_text())
    assert data["complete"] and data["meta"]["gpu"] == "Fake GPU" and sum(data["lengths"]) == 32768
    by = {(r["impl"], r["causal"]): r for r in data["records"]}
    assert by[("cupyflash", False)]["tflops"] == pytest.approx(500.0)
    assert by[("cupyflash", True)]["status"] == "refused"
    assert by[("fa3", False)]["status"] == "skipped" and "jax" in by[("fa3", False)]["reason"]
    tail = printed.out.strip().splitlines()
    assert tail[-1].startswith("json:") and any("1.25x" in line for line in tail)


def test_varlen_sdpa_on_a_jagged_nested_tensor_passes_the_per_sequence_check():
    """The nested-tensor plumbing (one offsets tensor, (B, j, H, D) -> (B, H, j, D), .values() back
    to packed) on the CPU with SDPA's MATH backend: its output passes the float64 check, and the
    same output with one sequence shifted does not."""
    torch = pytest.importorskip("torch")
    from cupyflash.config import DType

    p = varlen.make_problem(torch, DType.BF16, 16, 2, (3, 40, 1), False, seed=0, device="cpu")
    assert len(p.refs) == 3 * 2 and p.flops == varlen.varlen_flops([3, 40, 1], [3, 40, 1], 2, 16, False)
    check, _ = varlen.sdpa_nested_impl(torch, p, "MATH", warmup=0, iters=1)
    assert check() < 1e-2  # SPEC §5 bound for bf16
    dense = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        *(x[a:b].transpose(0, 1).float() for x in (p.q, p.k, p.v))).transpose(0, 1)
        for a, b in ((0, 3), (3, 43), (43, 44))])
    assert varlen.rel_l2_per_sequence(torch, p, dense) < 1e-5
    dense[3:43] = torch.roll(dense[3:43], 1, dims=0)  # sequence 1's rows out of place
    assert varlen.rel_l2_per_sequence(torch, p, dense) > 0.1


def test_decode_overhead_line():
    line = bench_mode_decode.format_overhead({"cupyflash": 11.0, "sdpa": 20.0})
    assert "forward_kvcache 11.0 us (ok <= 15 us)" in line and "SDPA 20.0 us" in line
    assert "MISS" in bench_mode_decode.format_overhead({"cupyflash": 16.0, "sdpa": 20.0})
    assert "; paged 12.5, splits4 14.0 us;" in bench_mode_decode.format_overhead(
        {"cupyflash": 11.0, "cupyflash_paged": 12.5, "cupyflash_splits4": 14.0, "sdpa": 20.0})
    assert "not measured" in bench_mode_decode.format_overhead({"error": "boom"})
    two = bench_mode_decode.format_overhead({"cupyflash": 9.3, "sdpa": 22.6, "launch_only": 4.3,
                                             "first_burst": {"cupyflash": 13.4, "sdpa": 28.1, "launch_only": 5.7}})
    assert "forward_kvcache 9.3 us (ok" in two and "bare launch 4.3 us" in two
    assert "first burst after a synchronize: forward_kvcache 13.4 us, SDPA 28.1, bare launch 5.7" in two


class _FakeCuda:
    """torch.cuda's synchronize/_sleep, recorded (no GPU)."""

    def __init__(self):
        self.log = []

    def synchronize(self):
        self.log.append("sync")

    def _sleep(self, cycles):
        self.log.append("sleep")


def test_issue_burst_times_two_bursts_behind_one_spin(monkeypatch):
    """Both bursts are issued behind the same spin, after a synchronize, and timed apart."""
    torch = types.SimpleNamespace(cuda=_FakeCuda())
    clock = iter([0.0, 0.002, 0.003])  # 2 ms, then 1 ms, for 100 calls each
    monkeypatch.setattr(bench_impls.time, "perf_counter", lambda: next(clock))
    calls = []
    first, second = bench_impls.issue_burst_us(torch, lambda: calls.append(torch.cuda.log[:]), 100)
    assert (first, second) == pytest.approx((20.0, 10.0))
    assert len(calls) == 200 and all(c == ["sync", "sleep"] for c in calls)


def test_host_cost_reports_the_steady_burst_and_the_first_one(monkeypatch):
    torch = types.SimpleNamespace(cuda=_FakeCuda())
    bursts = iter([(12.0, 9.0), (30.0, 22.0), (14.0, 9.5), (28.0, 23.0), (13.0, 9.2), (29.0, 22.5)])
    monkeypatch.setattr(bench_impls, "issue_burst_us", lambda torch, fn, calls: next(bursts))
    ran = []
    got = common.host_cost_us(torch, {"cupyflash": lambda: ran.append("c"), "sdpa": lambda: ran.append("s")},
                              rounds=3)
    assert got["cupyflash"] == 9.2 and got["sdpa"] == 22.5  # medians of the second bursts
    assert got["first_burst"] == {"cupyflash": 13.0, "sdpa": 29.0}
    assert ran == ["c", "c", "s", "s"]  # each case warmed twice before the rounds


def test_bar_plot_writes_png_or_says_why(tmp_path):
    path = tmp_path / "p.png"
    why = common.bar_plot(["bf16 d128", "fp16 d128"], {"cupyflash": [500.0, None], "fa3": [None, None]}, path,
                          "TFLOP/s", "fixture", log_y=True)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert why.startswith("matplotlib is not importable")
        return
    assert why is None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert common.bar_plot(["a"], {"x": [None]}, tmp_path / "q.png", "y", "t") == "no successful measurements to plot"


def test_decode_probe_ratios_take_each_allocations_own_cudnn(capsys):
    """decode_probe --allocs N --peer: a config's ratio in an allocation is to the mean of cuDNN's
    before/after times of the same allocation, and the line gives the median over allocations."""
    import decode_probe

    results = [{"row": "r", "config": "sdpa_cudnn_before", "contig": 100.0, "alloc": 0},
               {"row": "r", "config": "auto", "num_splits": None, "contig": 99.0, "alloc": 0},
               {"row": "r", "config": "sdpa_cudnn_after", "contig": 102.0, "alloc": 0},
               {"row": "r", "config": "sdpa_cudnn_before", "contig": 200.0, "alloc": 1},
               {"row": "r", "config": "auto", "num_splits": None, "contig": 210.0, "alloc": 1},
               {"row": "r", "config": "auto", "num_splits": 4, "contig": "RuntimeError: x", "alloc": 1},
               {"row": "r", "config": "sdpa_cudnn_after", "contig": 200.0, "alloc": 1},
               {"row": "r", "config": "auto", "num_splits": None, "contig": 101.0, "alloc": 2},
               {"row": "r", "config": "sdpa_cudnn_before", "contig": 101.0, "alloc": 2}]
    decode_probe.print_ratios(results)
    (line,) = capsys.readouterr().out.splitlines()
    assert "auto" in line and "over 3 allocations" in line
    assert "median 1.0000" in line and "(0.9802-1.0500)" in line
