"""scripts/probe_varlen_backward.py without a GPU: its batches."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import probe_varlen_backward as probe  # noqa: E402


def test_cases_pack_the_same_tokens():
    ragged = probe.lengths_of("ragged")
    assert sum(ragged) == probe.TOKENS and max(ragged) <= 8192 and len(ragged) > 4
    assert probe.lengths_of("sorted") == sorted(ragged, reverse=True)
    assert probe.lengths_of("eq4k") == [4096] * 8 and probe.lengths_of("eq8k") == [8192] * 4


def test_unknown_case_names_the_argument():
    with pytest.raises(ValueError, match="--cases"):
        probe.lengths_of("eq3")
