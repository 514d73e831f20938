"""scripts/sanitize_check.py's families without a GPU: --family/--varlen parsing, the launch sets
each family's script contributes, the runner's lines and summary, and the host references and
checks the launches are judged by."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from cupyflash.device import has_gpu

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import sanitize_backward  # noqa: E402
import sanitize_check  # noqa: E402
import sanitize_common  # noqa: E402
import sanitize_decode  # noqa: E402
import sanitize_sm90  # noqa: E402
import sanitize_varlen  # noqa: E402


def test_parse_families():
    assert sanitize_check.parse_families("all", varlen=False) == list(sanitize_check.FAMILIES)
    assert sanitize_check.parse_families("decode,forward_sm80", varlen=False) == ["decode", "forward_sm80"]
    assert sanitize_check.parse_families("backward_sm80", varlen=True) == ["backward_sm80", "varlen"]
    assert sanitize_check.parse_families("backward_sm90", varlen=False) == ["backward_sm90"]
    assert "backward_sm90" in sanitize_check.FAMILIES
    assert sanitize_check.parse_families("varlen,all", varlen=True) == ["varlen", *sanitize_check.FAMILIES]
    for bad in ("", "forward", "all,nope"):
        with pytest.raises(ValueError, match="--family"):
            sanitize_check.parse_families(bad, varlen=False)


def test_bad_arguments_exit_2(capsys):
    assert sanitize_check.main(["--family", "decodes"]) == 2
    assert sanitize_check.main(["--family", "decode,sm90"]) == 2
    assert "--family" in capsys.readouterr().err


def test_sanitize_sm90_rejects_unknown_options_and_bad_configs(capsys):
    for argv in (["--bogus"], ["--configs", "forward_sm90(BF16, 128, 128, 128, 2): tma+nope"]):
        with pytest.raises(SystemExit) as exc:
            sanitize_sm90.main(argv)
        assert exc.value.code == 2
    assert "--configs: cannot parse kernel config" in capsys.readouterr().err


@pytest.mark.skipif(has_gpu(), reason="with a GPU this would launch kernels")
def test_without_gpu_exits_2(capsys):
    assert sanitize_check.main(["--family", "all", "--varlen"]) == 2
    assert "no CUDA GPU found" in capsys.readouterr().err
    assert sanitize_sm90.main(["--quick"]) == 2 and sanitize_backward.main(["--max-shapes", "1"]) == 2
    assert "no CUDA GPU found" in capsys.readouterr().err


def test_each_family_contributes_its_launch_set():
    rng = np.random.default_rng(0)
    sm80 = list(sanitize_check.forward_sm80_launches(sanitize_check.pick_configs([64, 128], "first"), rng))
    assert len(sm80) == 2 * len(sanitize_check.SHAPES) * 2 and {x.family for x in sm80} == {"forward_sm80"}
    sm90 = list(sanitize_sm90.launches(rng, quick=True))
    assert len(sm90) == 4 * 2 * 2 and sanitize_sm90.THREE_CONSUMERS.split("(")[1] in sm90[-1].label
    assert "cpasync" in sm90[0].label  # the progression's first step: loads without TMA
    mine = sanitize_sm90.sanitize_configs()[:1]
    assert [x.label for x in sanitize_sm90.launches(rng, configs=mine)] == [
        x.label for x in sanitize_sm90.launches(rng) if x.label.startswith(str(mine[0]) + " ")]
    assert len(list(sanitize_sm90.launches(rng))) == len(sanitize_sm90.sanitize_configs()) * 3 * 2
    dec = list(sanitize_decode.launches(rng))
    assert len(dec) == len(sanitize_decode.CASES) and "lens=[0, 17, 300]" in dec[0].label
    bwd = list(sanitize_backward.launches(sanitize_backward.pick_configs("64,128"), sanitize_backward.SHAPES, rng))
    assert len(bwd) == 2 * len(sanitize_backward.SHAPES) * 2 * 2 and "det=1" in bwd[-1].label
    var = list(sanitize_varlen.launches(rng))
    assert len(var) == 2 * 2 * len(sanitize_varlen.FAMILIES) * len(sanitize_varlen.CASES)  # causal x zero_tail
    assert sum("zero_tail" in launch.label for launch in var) == len(var) // 2
    assert any(0 in lq for _, _, _, _, lq, _ in sanitize_varlen.CASES)  # empty sequences are covered


def test_runner_prints_a_line_per_launch_and_counts_failures():
    def boom():
        raise RuntimeError("cudaErrorIllegalAddress\nmore")

    launches = [sanitize_common.Launch("decode", "a", lambda: (True, "rel_l2 1e-3")),
                sanitize_common.Launch("decode", "b", lambda: (False, "rel_l2 0.5")),
                sanitize_common.Launch("varlen", "c", boom)]
    lines: list[str] = []
    done = sanitize_common.run_launches(launches, lines.append)
    assert lines == ["ok   [decode] a: rel_l2 1e-3", "FAIL [decode] b: rel_l2 0.5",
                     "FAIL [varlen] c: RuntimeError: cudaErrorIllegalAddress"]
    assert (done.runs, done.ok, done.failures) == (3, 1, ["[decode] b", "[varlen] c"])


def _naive(q, k, v, causal):
    """Row by row softmax in float64, for (S_q, D) x (S_k, D)."""
    out = np.zeros((q.shape[0], v.shape[1]))
    lse = np.full(q.shape[0], -np.inf)
    for i in range(q.shape[0]):
        seen = [j for j in range(k.shape[0]) if not causal or j <= i + k.shape[0] - q.shape[0]]
        if seen:
            s = np.array([q[i] @ k[j] for j in seen]) / np.sqrt(q.shape[1])
            w = np.exp(s - s.max())
            out[i] = (w / w.sum()) @ v[seen]
            lse[i] = s.max() + np.log(w.sum())
    return out, lse


@pytest.mark.parametrize("seq_q,seq_k", [(5, 9), (9, 5), (4, 0), (0, 3)])
def test_reference_against_a_naive_loop_gqa_and_empty(seq_q, seq_k):
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, seq_q, 4, 8))
    k, v = rng.standard_normal((2, seq_k, 2, 8)), rng.standard_normal((2, seq_k, 2, 8))
    for causal in (False, True):
        out, lse = sanitize_common.reference(q, k, v, causal)
        for b in range(2):
            for h in range(4):
                want, want_lse = _naive(q[b, :, h], k[b, :, h // 2], v[b, :, h // 2], causal)
                np.testing.assert_allclose(out[b, :, h], want, atol=1e-12)
                np.testing.assert_array_equal(np.isneginf(lse[b, h]), np.isneginf(want_lse))
                np.testing.assert_allclose(lse[b, h][np.isfinite(want_lse)], want_lse[np.isfinite(want_lse)])


def test_check_rules():
    ref = np.ones((1, 2, 1, 4))
    ref_lse = np.array([[[-np.inf, 1.0]]])
    assert sanitize_common.check(ref.copy(), ref_lse.copy(), ref, ref_lse)[0]
    bad = ref.copy()
    bad[0, 0, 0, 0] = np.nan
    assert not sanitize_common.check(bad, ref_lse.copy(), ref, ref_lse)[0]
    assert not sanitize_common.check(ref.copy(), np.array([[[0.0, 1.0]]]), ref, ref_lse)[0]  # masked row not -inf
    assert not sanitize_common.check(ref.copy(), np.array([[[-np.inf, np.nan]]]), ref, ref_lse)[0]
    assert not sanitize_common.check(ref * 1.1, ref_lse.copy(), ref, ref_lse)[0]
    zero = np.zeros_like(ref)  # every row masked: the output must be 0
    assert sanitize_common.check(zero, np.full((1, 1, 2), -np.inf), zero, np.full((1, 1, 2), -np.inf))[0]
    assert not sanitize_common.check(zero + 1, np.full((1, 1, 2), -np.inf), zero, np.full((1, 1, 2), -np.inf))[0]


def test_decode_key_gather_through_the_page_table():
    rng = np.random.default_rng(0)
    contiguous = rng.standard_normal((2, 48, 1, 4))
    table = rng.permutation(6).astype(np.int32).reshape(2, 3)  # 3 pages of 16 rows per sequence
    pages = np.empty((6, 16, 1, 4))
    for b in range(2):
        for p in range(3):
            pages[table[b, p]] = contiguous[b, 16 * p:16 * (p + 1)]
    for n in (0, 1, 16, 17, 48):
        np.testing.assert_array_equal(sanitize_decode._keys(pages, table, 1, n), contiguous[1, :n])
        np.testing.assert_array_equal(sanitize_decode._keys(contiguous, None, 1, n), contiguous[1, :n])


def test_varlen_offsets():
    np.testing.assert_array_equal(sanitize_varlen.cu_seqlens([0, 3, 0, 2]), [0, 0, 3, 3, 5])
    assert sanitize_varlen.cu_seqlens([4]).dtype == np.int32
