"""scripts/backward_table_from_bench.py without a GPU: which sweep result becomes a table entry."""
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import backward_table_from_bench as pick_mod  # noqa: E402

from cupyflash.config import DType  # noqa: E402
from cupyflash.families.backward_sm80.config import BackwardKernelConfig  # noqa: E402
from cupyflash.tuning import TuningTable  # noqa: E402

OLD = "backward_sm80 (BF16, 128, 64, 128, 8): dsplit_1+swizzled+dbuf+pds+pipe"
NEW = "backward_sm80 (BF16, 128, 64, 128, 8): dsplit_1+swizzled+dbuf+pds+pipe+dqf"
WRONG = "backward_sm80 (BF16, 128, 64, 128, 8): dsplit_1+swizzled+dbuf+pds+pipe+ldmid"
GOOD_ERR = [1e-3, 1e-3, 2e-4]


def row(seq, causal, auto_tflops, new_tflops, wrong_tflops=0.0, dtype="fp16"):
    """A bench_backward.py point: auto (the table's OLD) and two candidates, written as bf16 forms
    as --cfgs gives them (the point's dtype applies)."""
    auto = OLD.replace("BF16", dtype.upper())
    return {"dtype": dtype, "d_head": 128, "seq": seq, "batch": 16384 // seq, "heads": 16, "causal": causal,
            "auto_config": auto,
            "configs": {"auto": {"ms": 1.0, "tflops": auto_tflops, "rel_l2_vs_flash": GOOD_ERR},
                        NEW: {"ms": 0.9, "tflops": new_tflops, "rel_l2_vs_flash": GOOD_ERR},
                        WRONG: {"ms": 0.5, "tflops": wrong_tflops, "rel_l2_vs_flash": [0.5, 1e-3, 1e-3]}}}


def table():
    t = TuningTable(match="H100", family="backward_sm80")
    for seq in (1024, 4096):
        for causal in (False, True):
            t.set(BackwardKernelConfig.parse(OLD.replace("BF16", "FP16")), seq, 100.0, causal=causal)
    return t


def test_fastest_correct_candidate_replaces_the_entry_only_past_the_margin():
    t = table()
    sweep = {"rows": [row(1024, False, 250.0, 260.0, wrong_tflops=400.0),  # +4%: replaced; WRONG is dropped
                      row(4096, False, 300.0, 300.9),                      # +0.3%: kept
                      row(4096, True, 300.0, 299.0)]}                      # slower: kept
    changes = pick_mod.update(t, sweep, margin=0.005)
    assert len(changes) == 1 and "S=1024 causal=0" in changes[0]
    e = t.get(DType.FP16, 128, 1024, False)
    assert e.config.short_form() == NEW.replace("BF16", "FP16") and e.tflops == 260.0
    assert e.info["source"] == "bench_backward sweep" and e.info["candidates"] == 2
    for seq, causal in ((4096, False), (4096, True), (1024, True)):
        assert t.get(DType.FP16, 128, seq, causal).config.short_form() == OLD.replace("BF16", "FP16")


def test_main_updates_a_table_file_in_place(tmp_path, capsys):
    path = tmp_path / "t.json"
    table().save(path)
    sweep = tmp_path / "s.json"
    sweep.write_text(json.dumps({"meta": {"command": "bench", "date": "d", "device": "H100"},
                                 "rows": [row(4096, True, 250.0, 280.0)]}))
    assert pick_mod.main([str(sweep), "--table", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["meta"]["changed_by_sweeps"] == 1 and data["meta"]["sweeps"][0]["command"] == "bench"
    assert TuningTable.from_dict(data).get(DType.FP16, 128, 4096, True).config.dq_first
    assert "S=4096 causal=1" in capsys.readouterr().out
    # a second sweep appends its record; the first one's stays (its entries are still in the table)
    sweep.write_text(json.dumps({"meta": {"command": "bench2", "date": "d2", "device": "H100"},
                                 "rows": [row(1024, False, 250.0, 280.0)]}))
    assert pick_mod.main([str(sweep), "--table", str(path)]) == 0
    data = json.loads(path.read_text())
    assert [s["command"] for s in data["meta"]["sweeps"]] == ["bench", "bench2"]
    assert data["meta"]["changed_by_sweeps"] == 2
