"""benchmarks/verify_cost.py (BENCHMARKS.md, "What a verify pass costs"): every (context, rows)
cell measured on the real target, the table's ratios taken to the one-row pass of the same
context. Timings are printed by the benchmark, never asserted."""

from pathlib import Path

import pytest

from benchmarks import verify_cost as vc

ROOT = Path(__file__).resolve().parents[2]


def test_measure_every_cell_and_table(smollm2_gguf):
    res = vc.measure(str(smollm2_gguf), contexts=[8, 40], rows=[1, 3], threads=1, reps=1)
    assert sorted(res) == [8, 40] and all(sorted(v) == [1, 3] for v in res.values())
    assert all(ms > 0 for v in res.values() for ms in v.values())
    table = vc.markdown(res).splitlines()
    assert table[0] == "| rows | context 8: ms (x 1 row) | context 40: ms (x 1 row) |"
    assert table[2].startswith("| 1 | ") and table[2].count("(1.00x)") == 2
    want = f"{res[40][3]:.1f} ({res[40][3] / res[40][1]:.2f}x)"
    assert table[3].endswith(f" | {want} |")


def test_bad_arguments(tmp_path, capsys):
    with pytest.raises(SystemExit):
        vc.main(["-m", str(tmp_path / "missing.gguf")])
    assert "no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        vc.main(["-m", str(tmp_path / "missing.gguf"), "--rows", "0,2"])
    assert "positive integers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        vc.main(["-m", str(ROOT / "README.md"), "--reps", "0"])
    assert "--reps and --threads must be >= 1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="at most 512 rows"):
        vc.measure(str(tmp_path / "missing.gguf"), [8], [1, 600])
    with pytest.raises(ValueError, match="could not load"):
        (tmp_path / "junk.gguf").write_bytes(b"not a gguf")
        vc.measure(str(tmp_path / "junk.gguf"), [8], [1])
