"""The kernel-family seam: a second family (a toy with two kernels, two template flags and its own
parameter structs) goes through render, cache, registry, prewarm and tuning tables with no
change to them. No GPU needed; the toy compiles with NVRTC for real."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import ClassVar

import pytest

from cupyflash import families, prewarm as prewarm_mod, registry as registry_mod, render
from cupyflash.cache import KernelCache
from cupyflash.config import DType, KernelConfig
from cupyflash.families import (DEFAULT_FAMILY, FAMILIES, KernelFamily, KernelRole, ParamStruct, family_of,
                                get_family, parse_config, pick_family, register_family)
from cupyflash.families.forward_sm80 import FORWARD_SM80
from cupyflash.families.forward_sm80.config_sets import progression_configs
from cupyflash.tuning import TuningTable, TuningTableError, default_table_path, user_table_path

TOY_HEADER = r"""
template <ToyConfig C> struct StaticToy { static constexpr int SCALE = C.scale; };

template <class S, bool NEGATE, bool TWICE>
__global__ void toy_scale_kernel(const __grid_constant__ ToyScaleParams p) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < p.n) p.x[i] *= (NEGATE ? -S::SCALE : S::SCALE) * (TWICE ? 2 : 1);
}

template <class S, bool NEGATE, bool TWICE>
__global__ void toy_fill_kernel(const __grid_constant__ ToyFillParams p) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < p.n) p.y[i] = p.value;
}
"""


@dataclass(frozen=True, order=True)
class ToyConfig(KernelConfig):
    FAMILY: ClassVar[str] = "toy"

    dtype: DType
    d_head: int
    scale: int
    wide: bool

    def _rules(self):
        yield "scale in 1..8", 1 <= self.scale <= 8

    def short_form(self) -> str:
        return f"toy ({self.dtype.name}, {self.d_head}, {self.scale}): {'wide' if self.wide else 'narrow'}"

    @classmethod
    def parse(cls, text: str) -> "ToyConfig":
        m = re.fullmatch(r"toy \((\w+), (\d+), (\d+)\): (wide|narrow)", text.strip())
        if not m:
            raise ValueError(f"cannot parse toy config {text!r}")
        return cls(DType.parse(m.group(1)), int(m.group(2)), int(m.group(3)), m.group(4) == "wide")


class ToyFamily(KernelFamily):
    name = "toy"
    kind = "toy"
    description = "test family"
    config_type = ToyConfig
    template = "base.cu.j2"
    headers = ("toy/toy.cuh",)
    static_wrapper = "StaticToy"
    roles = (KernelRole("scale", "toy_scale_kernel", ParamStruct("ToyScaleParams", (("x", "float*", "Q"), ("n", "int", "i"), ("pad", "int", "i")))),
             KernelRole("fill", "toy_fill_kernel", ParamStruct("ToyFillParams", (("y", "float*", "Q"), ("n", "int", "i"), ("value", "float", "f")))))
    variant_flags = ("negate", "twice")
    set_keys = ("tune",)

    def config_set(self, key):
        if key != "tune":
            raise ValueError(f"unknown key {key!r}")
        return [ToyConfig(DType.FP16, 64, s, w) for s in (1, 2) for w in (False, True)]

    def block_threads(self, cfg, role=None):
        return 256 if cfg.wide else 128

    def smem_bytes(self, cfg, role=None):
        return 64 * 1024 if role == "fill" else 0


class HopperOnlyToy(ToyFamily):
    name = "toy90"
    headers = ("toy/toy90.cuh",)
    arch_suffix = "a"
    exact_compute_capability = 90
    priority = 5


@dataclass(frozen=True, order=True)
class Toy90Config(ToyConfig):
    FAMILY: ClassVar[str] = "toy90"


HopperOnlyToy.config_type = Toy90Config


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """The toy family registered for one test, with its header in a private kernels_cu folder."""
    (tmp_path / "toy").mkdir()
    (tmp_path / "toy" / "toy.cuh").write_text(TOY_HEADER)
    (tmp_path / "toy" / "toy90.cuh").write_text(TOY_HEADER.replace("ToyConfig", "Toy90Config"))
    monkeypatch.setattr(render, "kernels_dir", lambda: tmp_path)
    render.render_family_source.cache_clear()
    fam, fam90 = ToyFamily(), HopperOnlyToy()
    register_family(fam)
    register_family(fam90)
    yield fam
    for f in (fam, fam90):
        families.FAMILIES.pop(f.name, None)
        families._BY_TYPE.pop(f.config_type, None)
    render.render_family_source.cache_clear()


def test_the_seed_family_is_registered_and_is_the_default():
    assert DEFAULT_FAMILY == "forward_sm80" and FAMILIES["forward_sm80"] is FORWARD_SM80
    cfg = progression_configs()[-1]
    assert family_of(cfg) is FORWARD_SM80 and get_family("forward_sm80") is FORWARD_SM80
    assert parse_config(cfg.short_form()) == cfg  # SPEC §2's unprefixed short form
    assert FORWARD_SM80.name_expressions(cfg, (True, False)) == {"forward": render.name_expression(cfg, causal=True)}
    with pytest.raises(ValueError, match="unknown kernel family 'nope'"):
        get_family("nope")
    with pytest.raises(ValueError, match="unknown kernel family 'nope'"):
        parse_config("nope (FP16, 64): x")
    with pytest.raises(TypeError, match="cfg"):
        family_of("(FP16, 64, 64, 64, 4): async+load_0_0_0_tiles")
    assert pick_family("forward", 80) is FORWARD_SM80 and pick_family("forward", 89) is FORWARD_SM80
    assert pick_family("forward", 90).name == "forward_sm90"  # the Hopper family, on Hopper only
    assert pick_family("forward", 100) is FORWARD_SM80        # sm_90a code does not run on sm_100
    with pytest.raises(ValueError, match="no forward kernel family"):
        pick_family("forward", 75)


def test_registration_rules(toy):
    with pytest.raises(ValueError, match="taken"):
        register_family(ToyFamily())
    assert parse_config("toy (BF16, 128, 3): wide") == ToyConfig(DType.BF16, 128, 3, True)
    assert family_of(ToyConfig(DType.BF16, 128, 3, True)) is toy
    # the two families' short forms cannot collide: the seed's starts with '(', the toy's with its name
    assert all(c.short_form().startswith("(") for c in progression_configs())
    assert all(c.short_form().startswith("toy ") for c in toy.config_set("tune"))
    with pytest.raises(ValueError, match="rule violated: scale in 1..8"):
        ToyConfig(DType.FP16, 64, 9, False)
    assert pick_family("toy", 90).name == "toy90" and pick_family("toy", 80).name == "toy"  # priority


def test_variants(toy):
    assert toy.all_variants() == [(False, False), (False, True), (True, False), (True, True)]
    assert toy.variant(twice=True) == (False, True)
    assert toy.variant_label((True, True)) == " [negate,twice]" and toy.variant_label((False, False)) == ""
    with pytest.raises(ValueError, match="no flag"):
        toy.variant(causal=True)
    with pytest.raises(ValueError, match="expects 2 bools"):
        toy.check_variant((True,))


def test_render_generates_the_family_structs_and_inlines_its_headers(toy):
    src = render.render_family_source("toy")
    assert "struct ToyConfig {\n    DType dtype;\n    int d_head;\n    int scale;\n    bool wide;\n};" in src
    assert "struct ToyScaleParams {\n    float* x;\n    int n;\n    int pad;\n};" in src
    assert "struct ToyFillParams {" in src and "// ---- kernels_cu/toy/toy.cuh" in src
    assert "FlashForwardKernelConfig" not in src and "ForwardParams" not in src
    cfg = ToyConfig(DType.FP16, 64, 2, True)
    assert render.render_source([cfg]) == src
    with pytest.raises(ValueError, match="one translation unit per family"):
        render.render_source([cfg, progression_configs()[0]])
    names = toy.name_expressions(cfg, (True, False))
    assert names == {"scale": "toy_scale_kernel<StaticToy<ToyConfig{DType::FP16, 64, 2, true}>, true, false>",
                     "fill": "toy_fill_kernel<StaticToy<ToyConfig{DType::FP16, 64, 2, true}>, true, false>"}


def test_compile_cache_and_prewarm_work_for_a_second_family(toy, tmp_path):
    cache = KernelCache(tmp_path / "cache")
    cfg = ToyConfig(DType.FP16, 64, 2, True)
    lookup = registry_mod.compile_config(cfg, "sm_80", cache, variant=(True, True))
    assert set(lookup.module.lowered_names) == set(toy.name_expressions(cfg, (True, True)).values())
    assert lookup.key == registry_mod.config_cache_key(cfg, "sm_80", variant=(True, True))
    meta = cache.read_metadata(cache.entries()[0])
    assert meta["family"] == "toy" and meta["short_forms"] == [cfg.short_form() + " [negate,twice]"]
    # the family is part of the key: the same source and names under another family name differ
    src, names = render.render_family_source("toy"), list(toy.name_expressions(cfg, (True, True)).values())
    assert KernelCache.key(src, names, "sm_80", family="toy") == lookup.key
    assert KernelCache.key(src, names, "sm_80", family="other") != lookup.key

    report = prewarm_mod.prewarm(toy.config_set("tune"), ["sm_80"], cache_dir=tmp_path / "cache", jobs=1,
                                 progress=None, variants=toy.all_variants())
    assert report.ok and len(report.results) == 4 * 4
    assert sum(r.cached for r in report.results) == 1  # the entry compiled above
    assert {r.family for r in report.results} == {"toy"}
    assert all({role for role, *_ in r.roles} == {"scale", "fill"} for r in report.results if r.registers)
    assert "[negate,twice]" in prewarm_mod.format_summary(report)


def test_arch_rules(toy, tmp_path):
    toy90 = get_family("toy90")
    cfg = Toy90Config(DType.FP16, 64, 2, True)
    assert toy90.default_archs() == ("sm_90a",)
    with pytest.raises(ValueError, match="family toy90 compiles for sm_90a, not 'sm_80'"):
        prewarm_mod.prewarm([cfg], ["sm_80"], cache_dir=tmp_path, progress=None)
    with pytest.raises(ValueError, match="not 'sm_90'"):
        toy90.check_arch("sm_90")
    toy90.check_arch("sm_90a")
    with pytest.raises(ValueError, match="sm_80 or newer"):
        toy.check_arch("sm_75")
    report = prewarm_mod.prewarm([cfg], ["sm_90a"], cache_dir=tmp_path, progress=None, jobs=1)
    assert report.ok and report.results[0].arch == "sm_90a", report.results[0].error


def test_registry_loads_every_role_with_its_own_params_and_smem(toy, tmp_path, monkeypatch):
    import cupy
    from cupy_backends.cuda.api import driver

    from cupyflash import device

    attrs, fetched = [], []

    class FakeFunction:
        def __init__(self, name):
            self.ptr = hash(name) & 0xFFFF

    class FakeModule:
        def load(self, image):
            pass

        def get_function(self, name):
            fetched.append(name)
            return FakeFunction(name)

    class FakeDevice:
        def __init__(self, i):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(device, "compute_capability", lambda i: 80)
    monkeypatch.setattr(device, "device_arch", lambda i: ("sm_80", "cubin"))
    monkeypatch.setattr(cupy.cuda.function, "Module", FakeModule)
    monkeypatch.setattr(cupy.cuda, "Device", FakeDevice)
    monkeypatch.setattr(driver, "funcSetAttribute", lambda *a: attrs.append(a))
    reg = registry_mod.KernelRegistry(KernelCache(tmp_path))
    cfg = ToyConfig(DType.FP16, 64, 3, False)
    kernels = reg.get_all(cfg, device_id=0, variant=(False, True))
    assert set(kernels) == {"scale", "fill"} and len(fetched) == 2
    assert kernels["scale"].params_size == 16 and kernels["fill"].params_size == 16
    assert reg.get(cfg, 0, variant=(False, True), role="fill") is kernels["fill"]
    assert reg.get(cfg, 0, variant=(False, True)) is kernels["scale"]  # the family's first role
    assert [a[2] for a in attrs] == [64 * 1024]  # only the role above 48 KiB got the opt-in
    with pytest.raises(ValueError, match="params"):
        kernels["scale"].launch((1, 1, 1), 128, 0, 0, b"\0" * 8)
    with pytest.raises(ValueError, match="does not run on compute capability 8.0"):
        reg.get(Toy90Config(DType.FP16, 64, 3, False), 0)


def test_tuning_tables_carry_their_family(toy, tmp_path):
    table = TuningTable(device="NVIDIA H100 80GB HBM3", family="toy")
    cfg = ToyConfig(DType.BF16, 128, 4, True)
    table.set(cfg, 4096, 1.0)
    with pytest.raises(TypeError, match="table's family is toy"):
        table.set(progression_configs()[0], 4096)
    path = table.save(tmp_path / "t.json")
    back = TuningTable.load(path)
    assert back.family == "toy" and back.lookup("NVIDIA H100 80GB HBM3", DType.BF16, 128, 5000) == cfg
    seed = TuningTable(device="x")
    assert "family" not in seed.to_dict()  # the seed family's tables read as before
    assert TuningTable.from_dict(seed.to_dict()).family == DEFAULT_FAMILY
    with pytest.raises(TuningTableError, match="unknown kernel family"):
        TuningTable.from_dict({**seed.to_dict(), "family": "nope"})
    name = "NVIDIA H100 80GB HBM3"
    assert default_table_path(name).name == "default_h100.json"
    assert default_table_path(name, "toy").name == "default_h100.toy.json"
    assert user_table_path(name, tmp_path, "toy").name == "nvidia-h100-80gb-hbm3.toy.json"


def test_family_config_fields_become_the_cpp_struct_in_order():
    src = render.render_family_source(DEFAULT_FAMILY)
    body = re.search(r"struct FlashForwardKernelConfig \{(.*?)\};", src, re.S).group(1)
    assert [line.split()[-1].rstrip(";") for line in body.strip().splitlines()] == [
        f.name for f in dataclasses.fields(FORWARD_SM80.config_type)]
