"""cupyflash.op_launch: where the Hopper family's parameter block holds the five pointers.

CPU only: the TMA encoder is replaced by stand-ins whose layout is known, so the probe must find
the address words when nothing else depends on the address, and must refuse otherwise.
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from cupyflash import op_launch
from cupyflash.config import DType
from cupyflash.families.forward_sm80.config_sets import default_config
from cupyflash.families.forward_sm90 import tma
from cupyflash.families.forward_sm90.launch import make_repack, plan_sm90
from cupyflash.families.forward_sm90.params import PARAMS_SIZE
from cupyflash.interop import CUPY, TensorView
from fake_views import stand_in_encoder


def _views(shape=(2, 300, 8, 128), kv=(2, 257, 2, 128)):
    def view(s):
        strides = tuple(int(np.prod(s[i + 1:])) for i in range(4))
        return TensorView(0, s, strides, DType.BF16, None, 0, CUPY, None)

    return view(shape), view(kv), view(kv)


@pytest.fixture
def repack(monkeypatch):
    tma.clear_cache()
    q, k, v = _views()
    monkeypatch.setattr("cupyflash.families.forward_sm90.launch._sm_count", lambda device: 132)
    plan = plan_sm90(None, q, k, v, None, 0.1, True)
    yield make_repack(plan, q, k, v)
    tma.clear_cache()


def test_address_words_found_and_writes_match_thestand_in_encoder(monkeypatch, repack):
    monkeypatch.setattr(tma, "encode", stand_in_encoder(lambda a: (a, 0)))
    found = op_launch.address_offsets(repack, PARAMS_SIZE)
    assert found is not None
    offsets, template = found
    assert offsets == (24, 128 + 24, 256 + 24, 384, 392)  # word 3 of each descriptor, then o and lse
    buf = ctypes.create_string_buffer(template, len(template))  # the FastLaunch block's type
    write = op_launch.address_writer(buf, offsets)
    rng = np.random.default_rng(0)
    for _ in range(20):
        ptrs = [int(x) * 16 for x in rng.integers(1, 1 << 43, 5)]
        write(*ptrs)
        assert buf.raw == repack(*ptrs)


@pytest.mark.parametrize("address_word", [
    lambda a: (a >> 4, 0),                   # the address stored shifted: not a plain word
    lambda a: (a, (a >> 20) & 0xFF),         # another word depends on the address
    lambda a: (a & 0xFFFF_FFFF, a >> 32),    # split across two words
], ids=["shifted", "dependent-word", "split"])
def test_other_encodings_keep_encoding_per_call(monkeypatch, repack, address_word):
    monkeypatch.setattr(tma, "encode", stand_in_encoder(address_word))
    assert op_launch.address_offsets(repack, PARAMS_SIZE) is None


def test_encoder_refusing_stand_in_addresses(monkeypatch, repack):
    def refuse(spec):
        raise RuntimeError("cuTensorMapEncodeTiled failed with CUresult 1")

    monkeypatch.setattr(tma, "encode", refuse)
    assert op_launch.address_offsets(repack, PARAMS_SIZE) is None


def test_leading_writer_is_forward_params_prefix():
    from cupyflash.families.forward_sm80.params import PARAM_FIELDS
    from cupyflash.validation import check_forward_args

    q, k, v = _views((1, 64, 4, 64), (1, 64, 4, 64))
    plan = check_forward_args(None, q, k, v, None, None, False, select=lambda d, h, *_: default_config(d, h))
    params = plan.pack(0, 0, 0, 0, 0)
    buf = ctypes.create_string_buffer(params, len(params))
    op_launch.leading_writer(buf)(16, 32, 48, 64, 80)
    assert buf.raw == plan.pack(16, 32, 48, 64, 80)
    assert [name for name, _, _ in PARAM_FIELDS[:5]] == ["q", "k", "v", "o", "lse"]
