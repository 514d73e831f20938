"""CPU tests of forward_varlen: argument checks, the opt-in index check, parameter packing, the
varlen kernel variant's name and its compile (sm_80, sm_90: no spills, no ptxas warnings)."""
from __future__ import annotations

import numpy as np
import pytest

from cupyflash.config import DType
from cupyflash.families.forward_sm80 import FORWARD_SM80
from cupyflash.families.forward_sm80.config_sets import default_config
from cupyflash.families.forward_sm80.params import PARAMS_STRUCT, param_names
from fake_views import ints, view
from cupyflash.varlen import pack_varlen_sm80
from cupyflash.varlen_checks import check_index_values, check_varlen_args

BF16 = DType.BF16


def args(**over):
    a = dict(q=view((100, 16, 128)), k=view((300, 4, 128)), v=view((300, 4, 128)),
             cu_q=ints((4,)), cu_k=ints((4,)), max_seqlen_q=60, max_seqlen_k=200, out=None)
    a.update(over)
    return a


def check(**over):
    a = args(**over)
    return check_varlen_args(a["q"], a["k"], a["v"], a["cu_q"], a["cu_k"], a["max_seqlen_q"], a["max_seqlen_k"],
                             a["out"], a.get("softmax_scale"), a.get("causal", False))


def test_valid_problem():
    p = check(causal=True)
    assert (p.total_q, p.total_k, p.batch, p.n_heads, p.n_kv_heads, p.kv_group_size) == (100, 300, 3, 16, 4, 4)
    assert p.q_strides == (16 * 128, 128) and p.o_strides == (16 * 128, 128) and p.causal
    assert p.out_shape == (100, 16, 128) and p.lse_shape == (16, 100) and not p.empty
    assert abs(p.softmax_scale - 128 ** -0.5) < 1e-12
    # strided views (a slice of the head dimension) keep their strides
    q = view((100, 16, 128), strides=(32 * 128, 128, 1))
    assert check(q=q).q_strides == (32 * 128, 128)


@pytest.mark.parametrize("over, err, prefix", [
    (dict(q=view((100, 16, 128), dtype=None, raw=np.dtype(np.float32))), TypeError, "q:"),
    (dict(k=view((300, 4, 128), dtype=DType.FP16)), TypeError, "k:"),
    (dict(q=view((1, 100, 16, 128))), ValueError, "q:"),
    (dict(q=view((100, 16, 80))), ValueError, "k:"),
    (dict(q=view((100, 16, 80)), k=view((300, 4, 80)), v=view((300, 4, 80))), ValueError, "q:"),
    (dict(v=view((299, 4, 128))), ValueError, "v:"),
    (dict(q=view((100, 6, 128))), ValueError, "k:"),
    (dict(q=view((100, 16, 128), strides=(16 * 128, 128, 2))), ValueError, "q:"),
    (dict(k=view((300, 4, 128), strides=(4 * 128 + 4, 128, 1))), ValueError, "k:"),
    (dict(q=view((100, 16, 128), ptr=(1 << 30) + 8)), ValueError, "q:"),
    (dict(v=view((300, 4, 128), device=1)), ValueError, "v:"),
    (dict(cu_q=ints((4,), raw=np.dtype(np.int64))), TypeError, "cu_seqlens_q:"),
    (dict(cu_k=ints((4, 1))), ValueError, "cu_seqlens_k:"),
    (dict(cu_q=ints((0,))), ValueError, "cu_seqlens_q:"),
    (dict(cu_q=ints((4,), strides=(2,))), ValueError, "cu_seqlens_q:"),
    (dict(cu_k=ints((5,))), ValueError, "cu_seqlens_k:"),
    (dict(cu_k=ints((4,), device=1)), ValueError, "cu_seqlens_k:"),
    (dict(max_seqlen_q=-1), ValueError, "max_seqlen_q:"),
    (dict(max_seqlen_k=2.0), TypeError, "max_seqlen_k:"),
    (dict(max_seqlen_q=True), TypeError, "max_seqlen_q:"),
    (dict(max_seqlen_k=2**31), ValueError, "max_seqlen_k:"),
    (dict(out=view((100, 16, 64))), ValueError, "out:"),
    (dict(out=view((100, 16, 128), dtype=DType.FP16)), TypeError, "out:"),
    (dict(out=view((100, 16, 128), strides=(0, 128, 1))), ValueError, "out:"),
    (dict(out=view((100, 16, 128), device=1)), ValueError, "out:"),
    (dict(causal=1), TypeError, "causal:"),
    (dict(softmax_scale=float("nan")), ValueError, "softmax_scale:"),
])
def test_bad_arguments_name_the_argument(over, err, prefix):
    with pytest.raises(err) as info:
        check(**over)
    assert str(info.value).startswith(prefix), str(info.value)


def test_empty_problems():
    assert check(cu_q=ints((1,)), cu_k=ints((1,))).empty  # batch 0
    assert check(q=view((0, 16, 128))).empty
    assert check(max_seqlen_q=0).empty
    assert not check(max_seqlen_k=0).empty  # queries over no keys: output 0, lse -inf
    # a batch with no keys at all: CuPy gives size-0 arrays zero strides
    empty_kv = view((0, 4, 128), strides=(0, 0, 0))
    p = check(k=empty_kv, v=view((0, 4, 128), strides=(0, 0, 0)), max_seqlen_k=0)
    assert p.total_k == 0 and not p.empty


def test_index_check_on_host_copies():
    p = check()  # 100 q tokens, 300 k tokens, batch 3, max 60 / 200
    check_index_values(p, np.array([0, 10, 10, 70]), np.array([0, 200, 200, 300]))
    cases = [
        (np.array([1, 10, 10, 70]), np.array([0, 1, 2, 3]), "cu_seqlens_q: must start at 0"),
        (np.array([0, 10, 5, 70]), np.array([0, 1, 2, 3]), "cu_seqlens_q: offsets must not decrease"),
        (np.array([0, 10, 20, 101]), np.array([0, 1, 2, 3]), "cu_seqlens_q: the last offset 101"),
        (np.array([0, 61, 62, 63]), np.array([0, 1, 2, 3]), "max_seqlen_q: 60 is less than sequence 0"),
        (np.array([0, 1, 2, 3]), np.array([0, 1, 2, 301]), "cu_seqlens_k: the last offset 301"),
        (np.array([0, 1, 2, 3]), np.array([0, 1, 2, 203]), "max_seqlen_k: 200 is less than sequence 2"),
    ]
    for cu_q, cu_k, message in cases:
        with pytest.raises(ValueError) as info:
            check_index_values(p, cu_q, cu_k)
        assert str(info.value).startswith(message), str(info.value)


def test_packed_parameters():
    p = check(causal=True)
    fields = dict(zip(param_names(), PARAMS_STRUCT.unpack(pack_varlen_sm80(p, 1, 2, 3, 4, 5, 6, 7))))
    assert [fields[n] for n in ("q", "k", "v", "o", "lse", "cu_seqlens_q", "cu_seqlens_k")] == [1, 2, 3, 4, 5, 6, 7]
    assert (fields["q_batch_stride"], fields["q_seq_stride"], fields["q_head_stride"]) == (0, 16 * 128, 128)
    assert (fields["k_batch_stride"], fields["k_seq_stride"], fields["k_head_stride"]) == (0, 4 * 128, 128)
    assert (fields["seq_len_q"], fields["seq_len_k"], fields["kv_group_size"]) == (60, 200, 4)
    assert fields["lse_head_stride"] == 100  # lse is (n_heads, total_q)
    assert fields["tail_total_q"] == 0  # the rows past the last sequence are left as they are
    zeroing = dict(zip(param_names(), PARAMS_STRUCT.unpack(pack_varlen_sm80(p, 1, 2, 3, 4, 5, 6, 7, True))))
    assert zeroing["tail_total_q"] == 100 and {n: zeroing[n] for n in fields if n != "tail_total_q"} == {
        n: fields[n] for n in fields if n != "tail_total_q"}


def test_varlen_is_a_template_flag():
    cfg = default_config(BF16, 128)
    exprs = FORWARD_SM80.name_expressions(cfg, FORWARD_SM80.variant(causal=True, varlen=True))
    assert exprs["forward"].endswith(">, true, true>")
    assert FORWARD_SM80.variant(varlen=True) == (False, True)


def test_packed_parameters_sm90(monkeypatch):
    import struct

    from cupyflash.families.forward_sm90 import tma
    from cupyflash.families.forward_sm90.config_sets import default_config as sm90_default
    from cupyflash.families.forward_sm90.params import PARAMS_SIZE
    from cupyflash.varlen import pack_varlen_sm90

    seen = []
    monkeypatch.setattr(tma, "descriptor", lambda ptr, dtype, shape, strides, rows:
                        seen.append((ptr, shape, strides, rows)) or bytes([len(seen)]) * 128)
    a = args()
    p = check(causal=True)
    cfg = sm90_default(BF16, 128, True)
    packed = pack_varlen_sm90(cfg, p, a["q"], a["k"], a["v"], 4, 5, 6, 7)
    assert len(packed) == PARAMS_SIZE
    # packed arrays as one 'batch' of all tokens; boxes of B_r query rows and B_c key rows
    assert seen == [(a["q"].ptr, (1, 100, 16, 128), (0, 16 * 128, 128, 1), cfg.B_r),
                    (a["k"].ptr, (1, 300, 4, 128), (0, 4 * 128, 128, 1), cfg.B_c),
                    (a["v"].ptr, (1, 300, 4, 128), (0, 4 * 128, 128, 1), cfg.B_c)]
    assert struct.unpack_from("<QQQQqqq", packed, 384) == (4, 5, 6, 7, 0, 16 * 128, 128)
    assert struct.unpack_from("<iiii", packed, 384 + 56) == (60, 200, 16, 4)
    assert struct.unpack_from("<ffiiii", packed, 384 + 72)[2:] == (4, 3, 100, 0)  # group, batch, lse head stride, tail
    zeroing = pack_varlen_sm90(cfg, p, a["q"], a["k"], a["v"], 4, 5, 6, 7, True)
    assert struct.unpack_from("<i", zeroing, 384 + 92) == (100,)  # tail_total_q: the kernel zeroes the tail
    assert zeroing[384:384 + 92] == packed[384:384 + 92]  # the scalars before it are the same


def test_packed_parameters_sm90_cp_async(monkeypatch):
    """A cp_async config (forward_sm90's progression step 1) packs pointer-and-strides records over
    the packed arrays instead of tensor maps, and the fast path writes what the packer packs."""
    import ctypes
    import struct

    from cupyflash.families.forward_sm90 import tma
    from cupyflash.families.forward_sm90.config_sets import progression_configs
    from cupyflash.families.forward_sm90.params import DESCRIPTOR_OFFSETS, PARAMS_SIZE
    from cupyflash.varlen import pack_varlen_sm90, sm90_writer

    monkeypatch.setattr(tma, "encode", lambda spec: pytest.fail("a cp_async config encoded a tensor map"))
    a, p = args(), check(causal=True)
    cfg = progression_configs(BF16, 128)[0]
    assert cfg.cp_async

    def repack(q, k, v, o, lse, cq, ck):
        return pack_varlen_sm90(cfg, p, a["q"]._replace(ptr=q), a["k"]._replace(ptr=k), a["v"]._replace(ptr=v),
                                o, lse, cq, ck)

    packed = repack(a["q"].ptr, a["k"].ptr, a["v"].ptr, 4, 5, 6, 7)
    assert len(packed) == PARAMS_SIZE
    for name, x, strides in (("tma_q", a["q"], (0, 16 * 128, 128)), ("tma_k", a["k"], (0, 4 * 128, 128)),
                             ("tma_v", a["v"], (0, 4 * 128, 128))):
        assert struct.unpack_from("<Qqqq", packed, DESCRIPTOR_OFFSETS[name]) == (x.ptr, *strides), name
    assert struct.unpack_from("<QQQQ", packed, 384) == (4, 5, 6, 7)
    buf = ctypes.create_string_buffer(repack(a["q"].ptr, a["k"].ptr, a["v"].ptr, 1 << 30, 0, 1 << 32, 1 << 33),
                                      PARAMS_SIZE)
    write = sm90_writer(repack, PARAMS_SIZE)(buf)
    write(1 << 34, 1 << 35, 1 << 36, 1 << 37, 1 << 40, 1 << 38, 1 << 39)
    assert buf.raw == repack(1 << 34, 1 << 35, 1 << 36, 1 << 37, 1 << 40, 1 << 38, 1 << 39)
    write(1 << 34, 1 << 35, 1 << 36, 1 << 37, 0, 1 << 38, 1 << 39)  # without an lse
    assert buf.raw == repack(1 << 34, 1 << 35, 1 << 36, 1 << 37, 0, 1 << 38, 1 << 39)


@pytest.mark.parametrize("address_word", [lambda a: (a, 0), lambda a: (a >> 4, 0)], ids=["address-word", "shifted"])
def test_sm90_fast_path_writes_what_the_packer_packs(monkeypatch, address_word):
    """The Hopper varlen fast path stores seven pointer words where the driver's encoding allows it
    (and re-packs otherwise): either way the block equals a fresh pack of the call's pointers,
    with an lse (return_lse=True plans) or without."""
    import ctypes

    import numpy as np

    from cupyflash.families.forward_sm90 import tma
    from cupyflash.families.forward_sm90.config_sets import default_config as sm90_default
    from cupyflash.families.forward_sm90.params import PARAMS_SIZE
    from cupyflash.varlen import pack_varlen_sm90, sm90_writer
    from fake_views import stand_in_encoder

    monkeypatch.setattr(tma, "encode", stand_in_encoder(address_word))
    tma.clear_cache()
    a, p, cfg = args(), check(causal=False), sm90_default(BF16, 128, False)

    def repack(q, k, v, o, lse, cq, ck):
        return pack_varlen_sm90(cfg, p, a["q"]._replace(ptr=q), a["k"]._replace(ptr=k), a["v"]._replace(ptr=v),
                                o, lse, cq, ck)

    first = repack(a["q"].ptr, a["k"].ptr, a["v"].ptr, 1 << 30, 1 << 31, 1 << 32, 1 << 33)  # with an lse
    buf = ctypes.create_string_buffer(first, PARAMS_SIZE)
    write = sm90_writer(repack, PARAMS_SIZE)(buf)
    rng = np.random.default_rng(1)
    for _ in range(5):
        q, k, v, o, lse, cq, ck = (int(x) * 16 for x in rng.integers(1, 1 << 43, 7))
        for lse_ptr in (lse, 0):
            write(q, k, v, o, lse_ptr, cq, ck)
            assert buf.raw == repack(q, k, v, o, lse_ptr, cq, ck)
    tma.clear_cache()


@pytest.mark.compile
def test_sm90_varlen_variants_compile_without_warnings():
    import dataclasses

    from cupyflash.compiler import compile_module
    from cupyflash.families.forward_sm90 import FORWARD_SM90
    from cupyflash.families.forward_sm90.config_sets import default_config as sm90_default
    from cupyflash.families.forward_sm90.config_sets import varlen_default_config
    from cupyflash.render import render_family_source

    names = []
    for d in (64, 128, 256):
        for causal in (False, True):
            cfg = sm90_default(BF16, d, causal)
            picks = {cfg, dataclasses.replace(cfg, persistent=True), varlen_default_config(BF16, d, causal)}
            for c in sorted(picks):
                names += FORWARD_SM90.name_expressions(c, FORWARD_SM90.variant(causal=causal, varlen=True)).values()
    module = compile_module(render_family_source(FORWARD_SM90.name), names, "sm_90a")
    warnings = [line for line in module.log.splitlines() if "warning" in line.lower()]
    assert not warnings, "\n".join(warnings[:10])
    assert len(module.resources) == len(names)
    for name, r in module.resources.items():
        assert r.spill_store_bytes == 0 and r.spill_load_bytes == 0, (name, r)


@pytest.mark.compile
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_varlen_variants_compile_without_spills(arch):
    from cupyflash.compiler import compile_module
    from cupyflash.render import render_family_source

    source = render_family_source(FORWARD_SM80.name)
    names = [expr for dtype in DType for d in (64, 128, 256) for causal in (False, True)
             for expr in FORWARD_SM80.name_expressions(default_config(dtype, d),
                                                       FORWARD_SM80.variant(causal=causal, varlen=True)).values()]
    module = compile_module(source, names, arch)
    warnings = [line for line in module.log.splitlines() if "warning" in line.lower()]
    assert not warnings, "\n".join(warnings[:10])
    assert len(module.resources) == len(names)
    for name, r in module.resources.items():
        assert r.spill_store_bytes == 0 and r.spill_load_bytes == 0, (name, r)


def test_fast_path_signature_refuses_what_it_cannot_replay():
    from cupyflash import varlen_plans

    class Arr:  # neither torch nor CuPy
        pass

    a = Arr()
    assert varlen_plans.signature(None, None, False, False, 8, 8, a, a, a, a, a, None) is None
    assert varlen_plans.signature(None, None, 1, False, 8, 8, a, a, a, a, a, None) is None  # causal not a bool
    assert varlen_plans.signature(None, 0.5, True, True, 8.0, 8, a, a, a, a, a, None) is None  # max_seqlen not an int
    assert varlen_plans.lookup(None, a, a, a, a, a, None) is None
