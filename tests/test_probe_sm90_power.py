"""scripts/probe_sm90_power.py without a GPU: the line fit behind `tile-cost`, the nvidia-smi line
parser behind `clocks`, the wave-filling head count, and its argument checks."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import probe_sm90_power as probe  # noqa: E402


def test_fit_line_recovers_slope_and_intercept():
    xs = [8.0, 16.0, 32.0, 64.0]
    b, o = probe.fit_line(xs, [2.44 * x + 4.8 for x in xs])
    assert b == pytest.approx(2.44) and o == pytest.approx(4.8)
    with pytest.raises(ValueError, match="xs"):
        probe.fit_line([1.0, 1.0], [2.0, 3.0])


def test_parse_smi_line():
    assert probe.parse_smi_line("1605, 529.37\n") == (1605.0, 529.37)
    assert probe.parse_smi_line("[N/A], 12.0") is None
    assert probe.parse_smi_line("") is None


def test_waves_heads_fill_whole_waves():
    assert probe.waves_heads(22, 132) == (24, 4)   # 192-row tiles of 4224 rows
    assert probe.waves_heads(33, 132) == (16, 4)   # 128-row tiles
    heads, waves = probe.waves_heads(22, 114)
    assert 22 * heads == 114 * waves and waves >= 4


@pytest.mark.parametrize("argv, message", [
    (["clocks", "forward_sm90(BF16, 128, 128, 128, 2): tma+bogus"], "configs"),
    (["clocks", "forward_sm90(BF16, 128, 128, 128, 2): tma+ws", "forward_sm90(FP16, 128, 128, 128, 2): tma+ws"],
     "one dtype and d_head"),
])
def test_bad_arguments_name_the_argument(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        probe.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err
