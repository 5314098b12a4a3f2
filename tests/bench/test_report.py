"""`python -m tileflash bench report`: docs/performance.md is generated from benchmarks/results and kept current."""
import json

from tileflash.bench import report


def _write(directory, name, date, run, us, device="H200"):
    rows = [{"batch": 1, "ctx": 8192, "label": "gqa", "backends": {"tileflash": {"us": us, "ok": True},
                                                                   "sdpa": {"us": 22.0, "ok": True},
                                                                   "fa4": None}}]
    meta = {"date": date, "run": run, "device": device, "command": "bench decode", "notes": f"run {run}"}
    (directory / name).write_text(json.dumps({"env": {"torch": "x"}, "meta": meta, "decode": rows}))


def test_the_newest_file_of_a_suite_is_shown(tmp_path):
    _write(tmp_path, "b.json", "2026-12-01", 7, 31.5)
    _write(tmp_path, "a.json", "2026-12-02", 9, 20.5)  # newer, although it sorts first by name
    page = report.render(str(tmp_path))
    assert "20.5" in page and "31.5" not in page and "run 9" in page
    assert "tileflash us" in page and "sdpa us" in page and "fa4" not in page  # no column for a missing peer


def test_a_run_on_another_gpu_sits_beside_the_table(tmp_path):
    _write(tmp_path, "a.json", "2026-12-01", 7, 31.5, "NVIDIA H200")
    _write(tmp_path, "b.json", "2026-12-02", 8, 30.5, "NVIDIA H200")
    _write(tmp_path, "c.json", "2026-12-03", 9, 41.5, "NVIDIA H100 80GB HBM3")
    page = report.render(str(tmp_path))
    assert "30.5" in page and "41.5" in page and "31.5" not in page
    assert report._gpu({"device": "NVIDIA H100 80GB HBM3"}) == report._gpu({"device": "H100"}) == "H100"


def test_failed_backends_show_as_failures(tmp_path):
    _write(tmp_path, "a.json", "2026-12-02", 1, 20.0)
    data = json.loads((tmp_path / "a.json").read_text())
    data["decode"][0]["backends"]["tileflash"]["ok"] = False
    (tmp_path / "a.json").write_text(json.dumps(data))
    assert "FAIL" in report.render(str(tmp_path))


def test_performance_page_is_current():
    """A results file added without regenerating docs/performance.md fails here."""
    with open(report.PAGE) as f:
        assert f.read() == report.render(), "docs/performance.md is stale: run python -m tileflash bench report"


def test_sweep_rows_show_their_shapes(tmp_path):
    rows = [{"family": "decode", "shape": [1, 32768, 16], "variant": v, "us": us, "metric": 1.0, "unit": "TB/s",
             "ok": True} for v, us in (("default", 21.5), ("num_splits=8", 157.2))]
    meta = {"date": "2026-12-04", "run": 3, "device": "H200", "command": "sweep decode"}
    (tmp_path / "s.json").write_text(json.dumps({"family": "decode", "rows": rows, "meta": meta}))
    page = report.render(str(tmp_path))
    assert "| 1,32768,16 | num_splits=8 |" in page
