"""CPU tests of tileflash.bench: formulas, table, registries, peers, and the suites' plumbing
(run on CPU with a stand-in tileflash and a stand-in timer)."""

import json
import sys
import types

import pytest
import torch

from tileflash.bench import cli, formulas, peers, suites
from tileflash.bench.table import format_cell, format_table

CUDA = torch.cuda.is_available()


# ---- formulas ---------------------------------------------------------------------------------

def test_fwd_flops_exact():
    assert formulas.attn_fwd_flops(1, 16, 1024, 1024, 128, False) == 4 * 16 * 1024 * 1024 * 128
    assert formulas.attn_fwd_flops(1, 16, 1024, 1024, 128, True) == 2 * 16 * 1024 * 1024 * 128
    assert formulas.attn_fwd_flops(2, 8, 512, 2048, 64) == 4 * 2 * 8 * 512 * 2048 * 64
    # V's head dim other than q's: QK^T over 192, PV over 128
    assert formulas.attn_fwd_flops(1, 16, 1024, 1024, 192, False, 128) == 2 * 16 * 1024 * 1024 * (192 + 128)


def test_bwd_flops_is_two_and_a_half_fwd():
    for causal in (False, True):
        fwd = formulas.attn_fwd_flops(4, 32, 4096, 4096, 128, causal)
        assert formulas.attn_bwd_flops(4, 32, 4096, 4096, 128, causal) == 2.5 * fwd


def test_decode_bytes_exact():
    # b=1, 128k tokens, 8 kv heads, d=128, bf16: K and V are 256 MiB each.
    assert formulas.decode_kv_bytes(1, 131072, 8, 128) == 512 * 2**20
    assert formulas.decode_kv_bytes(2, 10, 3, 4, dtype_bytes=1) == 2 * 2 * 10 * 3 * 4


def test_gemm_formulas_exact():
    assert formulas.gemm_flops(16, 4096, 4096) == 2 * 16 * 4096 * 4096 == 536_870_912
    # NVFP4 [4096, 4096]: 8 MiB of packed e2m1 pairs + 1 MiB of e4m3 block scales (one per 16 elements).
    assert formulas.nvfp4_weight_bytes(4096, 4096) == 9 * 2**20
    assert formulas.nvfp4_weight_bytes(8192, 8192) == 32 * 2**20 + 4 * 2**20
    assert formulas.nvfp4_weight_bytes(3, 32) == 3 * 16 + 3 * 2
    assert formulas.gemm_weight_bytes(8192, 8192) == 128 * 2**20  # bf16
    assert formulas.gemm_weight_bytes(8192, 8192, dtype_bytes=1) == 64 * 2**20  # fp8
    assert formulas.gemm_weight_bytes(3, 5) == 30


def test_rates():
    assert formulas.tflops(1e12, 1000.0) == pytest.approx(1.0)
    assert formulas.tflops(695e9, 1.0) == pytest.approx(695.0)
    assert formulas.gbps(4.25e9, 1.0) == pytest.approx(4250.0)


def test_ceilings():
    assert (formulas.COPY_TBPS, formulas.BF16_GEMM_TFLOPS, formulas.FP8_GEMM_TFLOPS) == (4.25, 695, 1289)


# ---- table ------------------------------------------------------------------------------------

def test_format_cell():
    assert format_cell(None) == "-"
    assert format_cell(123.456) == "123.5"
    assert format_cell(0.934) == "0.93"
    assert format_cell(7) == "7"
    assert format_cell(True) == "yes"
    assert format_cell("abc") == "abc"


def test_format_table_alignment():
    text = format_table(["name", "value", "x"], [["a", 1.0, None], ["long-name", 1234.56, 5]], title="T")
    lines = text.splitlines()
    assert lines[0] == "T"
    assert lines[1] == lines[3] == lines[-1]  # the +---+ rules
    assert set(lines[1]) == {"+", "-"}
    assert len({len(line) for line in lines[1:]}) == 1  # every line the same width
    assert lines[4] == "| a         |   1.00 | - |"  # strings left, numbers right, None -> '-'
    assert lines[5] == "| long-name | 1234.6 | 5 |"
    assert lines[2] == "| name      |  value | x |"


def test_format_table_no_title_and_bad_row():
    assert format_table(["a"], [[1]]).splitlines()[0].startswith("+")
    with pytest.raises(ValueError):
        format_table(["a", "b"], [[1]])


# ---- registries -------------------------------------------------------------------------------

def test_prefill_registry():
    shapes = [s for s in suites.PREFILL_SHAPES if "dv" not in s]
    assert len(shapes) == 3 * 2 * 5
    for s in shapes:
        assert s["batch"] * s["seqlen"] == 16384
        assert s["nheads"] * s["d"] == 2048
    assert {s["d"] for s in shapes} == {64, 128, 256}
    assert {s["causal"] for s in shapes} == {False, True}
    assert sorted({s["seqlen"] for s in shapes}) == [1024, 2048, 4096, 8192, 16384]
    assert len({(s["d"], s["causal"], s["seqlen"]) for s in shapes}) == 30
    deepseek = suites.select_shapes(suites.PREFILL_SHAPES, only="d192v128")
    assert len(deepseek) == 6 and all((s["d"], s["dv"], s["nheads"]) == (192, 128, 16) for s in deepseek)
    assert len(suites.PREFILL_SHAPES) == 36


def test_decode_registry():
    grid = [(1, 8192), (1, 32768), (1, 131072), (8, 8192), (8, 32768),
            (32, 2048), (32, 8192), (64, 4096), (128, 1024), (256, 2048)]
    assert list(suites.DECODE_GRID) == grid
    shapes = suites.DECODE_SHAPES
    assert len(shapes) == 5 * 10
    by_label = {}
    for s in shapes:
        assert set(s) == {"batch", "ctx", "hq", "hkv", "d", "page_size", "label"}
        by_label.setdefault(s["label"], []).append(s)
    for rows in by_label.values():
        assert [(s["batch"], s["ctx"]) for s in rows] == grid
    heads = {lbl: {(s["hq"], s["hkv"], s["d"], s["page_size"]) for s in rows} for lbl, rows in by_label.items()}
    assert heads == {
        "gqa": {(32, 8, 128, None)},
        "gqa-page16": {(32, 8, 128, 16)},
        "gqa-page64": {(32, 8, 128, 64)},
        "mqa": {(8, 1, 128, None)},
        "gqa-d64": {(32, 8, 64, None)},
    }
    for s in shapes:  # pages tile the context exactly, also FlashInfer's 16-token view
        assert s["ctx"] % 16 == 0 and (s["page_size"] is None or s["ctx"] % s["page_size"] == 0)


def test_select_shapes():
    quick = suites.select_shapes(suites.DECODE_SHAPES, quick=True)
    assert len(quick) == 15
    assert [(s["batch"], s["ctx"]) for s in quick[:3]] == [(1, 8192), (1, 32768), (1, 131072)]
    paged = suites.select_shapes(suites.DECODE_SHAPES, only="page")
    assert {s["label"] for s in paged} == {"gqa-page16", "gqa-page64"} and len(paged) == 20
    assert {s["label"] for s in suites.select_shapes(suites.DECODE_SHAPES, only="d64")} == {"gqa-d64"}
    causal = suites.select_shapes(suites.PREFILL_SHAPES, quick=True, only="causal")
    assert len(causal) == 12 and all(s["causal"] for s in causal)  # 3 head dims and DeepSeek's 192 / 128
    assert all(s["seqlen"] <= 4096 for s in causal if "dv" not in s)
    assert suites.select_shapes(suites.PREFILL_SHAPES, only="nothing") == []
    assert suites.select_shapes(suites.PREFILL_SHAPES) == suites.PREFILL_SHAPES


# ---- reference and peers ----------------------------------------------------------------------

def _attn(q, k, v, causal):
    """Plain softmax attention, [B, S, H, D], fp32, bottom-right causal mask."""
    g = q.shape[2] // k.shape[2]
    k, v = (x.float().repeat_interleave(g, dim=2) for x in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k) / q.shape[-1] ** 0.5
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(sk - sq + 1), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)


@pytest.mark.parametrize("causal", [False, True])
def test_reference_fp32_gqa(causal):
    q, k, v = torch.randn(2, 16, 4, 8), torch.randn(2, 16, 2, 8), torch.randn(2, 16, 2, 8)
    torch.testing.assert_close(suites.reference_fp32(q, k, v, causal), _attn(q, k, v, causal))


def test_available_peers_are_bools():
    avail = peers.available_peers()
    assert set(avail) == {"sdpa_flash", "sdpa_cudnn", "sdpa", "fa4", "flashinfer", "torch_fp8"}
    assert all(isinstance(x, bool) for x in avail.values())
    if not CUDA:
        assert not any(avail.values())


@pytest.mark.skipif(CUDA, reason="CPU behaviour")
def test_peer_failure_is_none_and_noted():
    q = torch.randn(1, 8, 2, 16, dtype=torch.bfloat16)
    notes = []
    assert peers.sdpa_prefill(q, q, q, False, "cudnn", note=notes.append) is None  # no cuDNN on CPU
    assert len(notes) == 1 and "sdpa_cudnn" in notes[0]


def test_missing_libraries_give_none(monkeypatch):
    monkeypatch.setattr(peers, "_import", lambda name: None)
    q = torch.randn(1, 8, 2, 16)
    table = torch.zeros(1, 1, dtype=torch.int32)
    assert peers.fa4_prefill(q, q, q, True) is None
    assert peers.fa4_decode(q[:, :1], q, q, torch.full((1,), 8, dtype=torch.int32)) is None
    assert peers.flashinfer_decode(q[:, :1], q.view(1, 8, 2, 16), q.view(1, 8, 2, 16), table, 8, False) is None


def test_fa4_falls_back_without_num_splits(monkeypatch):
    calls = []

    def flash_attn_func(q, k, v, causal=False, **kw):
        calls.append(kw)
        if "num_splits" in kw:
            raise TypeError("unexpected keyword argument 'num_splits'")
        return q, None  # (out, lse)

    monkeypatch.setattr(peers, "_import", lambda name: types.SimpleNamespace(flash_attn_func=flash_attn_func))
    q = torch.randn(2, 1, 4, 16)
    notes = []
    fn = peers.fa4_decode(q, q, q, None, note=notes.append)
    assert fn is not None and fn() is q
    assert calls[0] == {"num_splits": 0} and calls[-1] == {} and len(notes) == 1


def test_sdpa_peers_layout_cpu():
    q, k, v = (torch.randn(2, 32, 4, 16) for _ in range(3))
    fn = peers.sdpa_prefill(q, k, v, True, "flash")
    if fn is not None:  # CPU builds of torch have a flash kernel; skip the check where they don't
        torch.testing.assert_close(fn(), _attn(q, k, v, True), atol=1e-4, rtol=1e-4)
    qd, kd, vd = torch.randn(3, 1, 8, 16), torch.randn(3, 40, 2, 16), torch.randn(3, 40, 2, 16)
    fn = peers.sdpa_decode(qd, kd, vd)
    assert fn is not None
    torch.testing.assert_close(fn(), _attn(qd, kd, vd, False), atol=1e-4, rtol=1e-4)
    for heads in (1, 2):  # a copy of its own for every timed copy, one KV head (MQA) included
        x = torch.randn(3, 40, heads, 16)
        y = peers.heads_major_copy(x)
        assert y.data_ptr() != x.data_ptr() and y.is_contiguous() and torch.equal(y, x.transpose(1, 2))


# ---- suites, on CPU with a stand-in tileflash -------------------------------------------------

def _fake_tileflash(mode="right"):
    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, **kw):
        if mode == "raise":
            raise RuntimeError("kernel exploded")
        out = _attn(q, k, v, causal).to(q.dtype)
        return out + 1 if mode == "wrong" else out

    def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, block_table=None,
                                causal=True, sp_overlap=False, **kw):
        if block_table is not None:
            k_cache, v_cache = (x[block_table.long()].flatten(1, 2) for x in (k_cache, v_cache))
        n = int(cache_seqlens.max())
        out = _attn(q, k_cache[:, :n], v_cache[:, :n], causal).to(q.dtype)
        return out + 1 if mode == "wrong" and sp_overlap else out

    return types.SimpleNamespace(flash_attn_func=flash_attn_func, flash_attn_with_kvcache=flash_attn_with_kvcache)


def _cpu_timing(monkeypatch):
    """The suites on the CPU: fixed timings (no CUDA graphs), two input copies for the rotating columns."""
    monkeypatch.setattr(suites, "DEVICE", "cpu")
    monkeypatch.setattr(suites, "bench_ms", lambda fn: 0.5)
    monkeypatch.setattr(suites, "graphed", lambda fn: fn)
    monkeypatch.setattr(suites, "rotating_graph_ms", lambda fns: 0.5 if fns and all(map(callable, fns)) else None)
    monkeypatch.setattr(suites, "rotation_copies", lambda nbytes: 2)


@pytest.fixture
def cpu_suites(monkeypatch):
    _cpu_timing(monkeypatch)

    def use(mode):
        monkeypatch.setitem(sys.modules, "tileflash", _fake_tileflash(mode))

    return use


PREFILL_TINY = [{"batch": 2, "seqlen": 64, "nheads": 4, "d": 32, "causal": c, "label": "t"} for c in (False, True)]
DECODE_TINY = [
    {"batch": 5, "ctx": 64, "hq": 4, "hkv": 2, "d": 32, "page_size": ps, "label": lbl}
    for lbl, ps in (("contig", None), ("paged16", 16))
]


def test_run_prefill_cpu(cpu_suites):
    cpu_suites("right")
    lines = []
    rows = suites.run_prefill(PREFILL_TINY, out=lines.append)
    assert len(rows) == 2
    json.dumps(rows)
    for row in rows:
        tf = row["backends"]["tileflash"]
        assert tf["ok"] and tf["max_err"] <= suites.TOL and tf["ms"] == 0.5
        flops = formulas.attn_fwd_flops(2, 4, 64, 64, 32, row["causal"])
        assert tf["TFLOP/s"] == pytest.approx(formulas.tflops(flops, 0.5))
        assert row["pct_bf16_gemm"] == pytest.approx(100 * tf["TFLOP/s"] / 695)
        assert row["backends"]["fa4"] is None or not CUDA
    assert "Prefill forward" in lines[-1] and "TFLOP/s" in lines[-1]


def test_run_prefill_cpu_head_dim_v(cpu_suites):
    """A row whose V head dim differs from q's: checked against the reference, FLOPs of both products, no FP8
    column (FP8 attention takes equal head dims), d shown as d/dv."""
    cpu_suites("right")
    lines = []
    row, = suites.run_prefill([{**PREFILL_TINY[1], "dv": 16}], out=lines.append)
    tf = row["backends"]["tileflash"]
    assert tf["ok"] and tf["TFLOP/s"] == pytest.approx(formulas.tflops(formulas.attn_fwd_flops(2, 4, 64, 64, 32, True,
                                                                                                 16), 0.5))
    assert row["backends"]["tileflash_fp8"] is None and row["fp8_vs_bf16"] is None
    assert "32/16" in lines[-1]


def test_run_prefill_records_wrong_and_raising(cpu_suites):
    cpu_suites("wrong")
    lines = []
    row = suites.run_prefill(PREFILL_TINY[:1], out=lines.append)[0]
    tf = row["backends"]["tileflash"]
    assert tf["ok"] is False and tf["max_err"] > suites.TOL and tf["ms"] == 0.5
    assert row["speedup"] is None  # a wrong tileflash is never compared
    assert any("FAIL: tileflash" in line for line in lines)
    assert "tileflash" in lines[-1].splitlines()[-2]  # the 'failed' column

    cpu_suites("raise")
    lines = []
    row = suites.run_prefill(PREFILL_TINY[:1], out=lines.append)[0]
    tf = row["backends"]["tileflash"]
    assert tf["ms"] is None and "kernel exploded" in tf["error"] and row["pct_bf16_gemm"] is None
    json.dumps(row)


def test_run_decode_cpu(cpu_suites):
    cpu_suites("right")
    lines = []
    rows = suites.run_decode(DECODE_TINY, out=lines.append)
    assert [r["label"] for r in rows] == ["contig", "paged16"]
    json.dumps(rows)
    nbytes = formulas.decode_kv_bytes(5, 64, 2, 32)
    for row in rows:
        assert row["kv_bytes"] == nbytes
        for name in suites.TILEFLASH_DECODE + ("sdpa", "sdpa_graph"):
            rec = row["backends"][name]
            assert rec["ok"], (row["label"], name, rec)
            assert rec["us"] == 500.0 and rec["GB/s"] == pytest.approx(formulas.gbps(nbytes, 0.5))
        assert row["speedup"] == pytest.approx(1.0)
        assert row["pct_copy"] == pytest.approx(100 * formulas.gbps(nbytes, 0.5) / 4250)
    assert "Decode" in lines[-1]


def test_run_decode_flags_sp_overlap_mismatch(cpu_suites):
    cpu_suites("wrong")  # only the sp_overlap=True path is wrong
    row = suites.run_decode(DECODE_TINY[1:], out=lambda s: None)[0]
    assert row["backends"]["tileflash"]["ok"] and not row["backends"]["tileflash_sp"]["ok"]
    assert row["speedup"] == pytest.approx(1.0)


def test_host_timing_takes_turns_and_splits_host_from_wall():
    """bench host's timer: each callable's medians, wall and host part (before the sync), the host part no larger;
    the callables take turns (a slow spell falls on all of them), each called calls x repeats times plus warm-up."""
    from tileflash.bench.host import eager_and_host_us, eager_us

    order = []
    fns = {"a": lambda: order.append("a"), "b": lambda: order.append("b")}
    wall, host = eager_and_host_us(fns, "cpu", calls=2, repeats=3)
    assert set(wall) == set(host) == {"a", "b"} and all(0 <= host[k] <= wall[k] for k in fns)
    assert order == ["a"] * 3 + ["b"] * 3 + (["a"] * 2 + ["b"] * 2) * 3
    assert set(eager_us(fns, "cpu", calls=1, repeats=1)) == {"a", "b"}


def test_host_one_thread_rows_turn_autograds_device_thread_off():
    """bench host's `..., 1-thread autograd` backends time with autograd's device thread off, the others with it as
    the caller left it; the setting comes back after each timed batch."""
    import torch

    from tileflash.bench.host import ONE_THREAD, _backend_context

    seen = {}
    for name in ("tileflash", "tileflash" + ONE_THREAD, "sdpa_flash", "sdpa_flash" + ONE_THREAD):
        with _backend_context(name):
            seen[name] = torch._C._is_multithreading_enabled()
        assert torch._C._is_multithreading_enabled()
    assert seen == {"tileflash": True, "tileflash" + ONE_THREAD: False, "sdpa_flash": True,
                    "sdpa_flash" + ONE_THREAD: False}


def test_speedup_uses_best_passing_runs():
    def rec(ms, ok=True):
        return {"ms": ms, "ok": ok}

    results = {"tileflash": rec(2.0), "tileflash_graph": rec(1.0), "sdpa": rec(3.0),
               "fi": rec(0.1, ok=False), "fa4": None}  # the fast peer is wrong, so it doesn't count
    assert suites.speedup(results, suites.TILEFLASH_DECODE) == pytest.approx(3.0)
    assert suites.speedup({"tileflash": rec(1.0)}, ("tileflash",)) is None


# ---- cli --------------------------------------------------------------------------------------

@pytest.mark.skipif(CUDA, reason="CPU behaviour")
def test_cli_without_gpu_exits_1(capsys):
    assert cli.main(["prefill", "--quick"]) == 1
    assert "CUDA" in capsys.readouterr().err


def test_cli_runs_selected_shapes_and_writes_json(monkeypatch, tmp_path):
    seen = {}

    def fake_runner(name):
        def run(shapes):
            seen[name] = shapes
            return [{"n": len(shapes)}]
        return run

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cli, "environment", lambda args=None: {"device": "fake"})
    monkeypatch.setitem(cli.SUITES, "prefill", (suites.PREFILL_SHAPES, fake_runner("prefill")))
    monkeypatch.setitem(cli.SUITES, "decode", (suites.DECODE_SHAPES, fake_runner("decode")))
    monkeypatch.setitem(cli.SUITES, "backward", (suites.BACKWARD_SHAPES, fake_runner("backward")))
    monkeypatch.setitem(cli.SUITES, "dropout", (suites.DROPOUT_SHAPES, fake_runner("dropout")))
    path = tmp_path / "r.json"
    assert cli.main(["all", "--quick", "--only", "d64", "--json", str(path)]) == 0
    assert [s["label"] for s in seen["prefill"]] == ["d64-full"] * 3 + ["d64-causal"] * 3
    assert len(seen["decode"]) == 3 and all(s["label"] == "gqa-d64" for s in seen["decode"])
    assert [s["label"] for s in seen["backward"]] == ["d64-full"] * 3 + ["d64-causal"] * 3
    data = json.loads(path.read_text())
    assert [s["label"] for s in seen["dropout"]] == ["dropout-d64", "dropout-d64-causal"]
    assert data == {"env": {"device": "fake", "flush": "zero"}, "prefill": [{"n": 6}], "decode": [{"n": 3}],
                    "backward": [{"n": 6}], "dropout": [{"n": 2}]}
    with pytest.raises(SystemExit):
        cli.main(["bogus"])


# Each suite's calls on tiny shapes (one test each, so that a parallel run spreads them over its workers).
REAL_SUITE_CALLS = {
    "prefill": lambda: suites.run_prefill(PREFILL_TINY, out=lambda s: None),
    "decode": lambda: suites.run_decode(DECODE_TINY + [{**s, "kv": "fp8"} for s in DECODE_TINY], out=lambda s: None),
    "backward": lambda: suites.run_backward([{**s, "batch": 1, "seqlen": 40, "nheads": 2} for s in PREFILL_TINY],
                                            out=lambda s: None),
    "extend": lambda: suites.run_extend([{"batch": 2, "prefix": 40, "sq": 20, "hq": 4, "hkv": 2, "d": 64,
                                          "page_size": 16, "label": "page16"}], out=lambda s: None),
    "mla": lambda: suites.run_decode([{"kind": "mla", "hq": 16, "batch": 2, "ctx": 32, "page_size": ps, "label": "mla",
                                       **({"kv": "fp8"} if fp8 else {})} for ps, fp8 in ((16, False), (None, True))],
                                     out=lambda s: None),
    "sinks": lambda: suites.run_sinks([{"kind": kind, "batch": 2, "seqlen": 40, "nheads": 4, "hkv": 2, "d": 32,
                                        "window": w, "label": kind} for kind, w in (("prefill", 15), ("decode", None))],
                                      out=lambda s: None),
    "dropout": lambda: suites.run_dropout([{"batch": 1, "seqlen": 40, "nheads": 2, "d": 32, "causal": c,
                                            "label": "dropout"} for c in (False, True)], out=lambda s: None),
}


@pytest.mark.skipif(CUDA, reason="runs the real kernels through Triton's CPU interpreter")
@pytest.mark.parametrize("suite", REAL_SUITE_CALLS)
def test_suites_call_real_tileflash_cpu(monkeypatch, suite):
    """The suites' calls match tileflash's real API and agree with the fp32 reference."""
    _cpu_timing(monkeypatch)
    rows = REAL_SUITE_CALLS[suite]()
    assert rows
    for row in rows:
        for name, rec in row["backends"].items():
            if name.startswith("tileflash"):
                assert rec["ok"], (row["label"], name, rec)


def test_run_backward_cpu(cpu_suites):
    cpu_suites("right")
    lines = []
    shapes = [{"batch": 1, "seqlen": 32, "nheads": 2, "d": 16, "causal": c, "label": "t"} for c in (False, True)]
    rows = suites.run_backward(shapes, out=lines.append)
    json.dumps(rows)
    for row in rows:
        tf = row["backends"]["tileflash"]
        assert tf["ok"], tf
        flops = formulas.attn_bwd_flops(1, 2, 32, 32, 16, row["causal"])
        assert tf["TFLOP/s"] == pytest.approx(formulas.tflops(flops, 0.5))
    assert "Backward" in lines[-1]


def test_lowp_registry():
    pages = {"fp8": (None, 16, 64), "nvfp4": (None,)}  # FP8 also paged, as engines keep it
    assert [(s["kv"], s["page_size"], s["batch"], s["ctx"]) for s in suites.LOWP_DECODE_SHAPES] == [
        (fmt, ps, b, ctx) for fmt in ("fp8", "nvfp4") for ps in pages[fmt] for b, ctx in suites.DECODE_GRID]
    assert all(s["kind"] == "decode" and s["label"] == f"gqa-{s['kv']}" + (f"-page{s['page_size']}" if s["page_size"]
                                                                            else "")
               for s in suites.LOWP_DECODE_SHAPES)


def test_gemm_registry():
    shapes = suites.GEMM_SHAPES
    assert len(shapes) == 16
    assert [(s["m"], s["n"], s["k"]) for s in shapes] == (
        [(m, nk, nk) for nk in (4096, 8192) for m in (1, 16, 64, 128, 1024, 4096)]
        + [(m, 28672, 4096) for m in (1, 16, 64, 128)])
    for s in shapes:
        assert set(s) == {"kind", "m", "n", "k", "label"}
        assert s["kind"] == "gemm"
        assert s["label"] == (f"gemm-{s['n'] // 1024}k" if s["n"] == s["k"] else "gemm-mlp")
    assert suites.LOWP_SHAPES == suites.LOWP_DECODE_SHAPES + shapes
    # --quick keeps the decode-sized and serving M of each weight; --only picks one half of the lowp suite.
    quick = suites.select_shapes(suites.LOWP_SHAPES, quick=True)
    assert len(quick) == 3 * 3 + 3 + 9  # fp8 decode (contiguous, page 16, page 64), nvfp4 decode, gemm
    assert [(s["m"], s["n"]) for s in quick if s["kind"] == "gemm"] == [
        (m, n) for n in (4096, 8192, 28672) for m in (1, 16, 64)]
    assert suites.select_shapes(suites.LOWP_SHAPES, only="gemm") == shapes
    assert suites.select_shapes(suites.LOWP_SHAPES, only="fp8") == [
        s for s in suites.LOWP_DECODE_SHAPES if s["kv"] == "fp8"]
    assert suites.select_shapes(suites.LOWP_SHAPES, only="8k") == shapes[6:12]
    for registry in (suites.PREFILL_SHAPES, suites.DECODE_SHAPES, suites.BACKWARD_SHAPES):
        assert not suites.select_shapes(registry, only="gemm") and not suites.select_shapes(registry, only="8k")
    assert cli.SUITES["lowp"] == (suites.LOWP_SHAPES, suites.run_lowp)


def test_backward_registry():
    assert len(suites.BACKWARD_SHAPES) == 12
    for s in suites.BACKWARD_SHAPES:
        assert s["batch"] * s["seqlen"] == 16384 and s["nheads"] * s["d"] == 2048


def test_progress_bar():
    assert suites.progress(0, 4, width=8) == "[........] 0/4"
    assert suites.progress(2, 4, width=8) == "[####....] 2/4"
    assert suites.progress(12, 12, width=8) == "[########] 12/12"


def test_plot_series_and_png(tmp_path):
    from tileflash.bench import plots

    rows = [{"d": 64, "causal": True, "seqlen": 4096,
             "backends": {"tileflash": {"TFLOP/s": 400.0}, "sdpa_cudnn": {"TFLOP/s": 450.0}, "fa4": None}}]
    labels, data = plots.series("prefill", rows)
    assert labels == ["d64 c 4k"] and data == {"tileflash": [400.0], "sdpa_cudnn": [450.0]}
    pytest.importorskip("matplotlib")
    (path,) = plots.write_charts({"prefill": rows}, str(tmp_path))
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


# ---- GEMM (low precision) ---------------------------------------------------------------------

GEMM_TINY = [{"kind": "gemm", "m": m, "n": 64, "k": 64, "label": "gemm-tiny"} for m in (1, 17)]


@pytest.fixture
def cpu_timer(monkeypatch):
    monkeypatch.setattr(suites, "DEVICE", "cpu")
    monkeypatch.setattr(suites, "bench_ms", lambda fn: 0.5)
    monkeypatch.setattr(suites, "graphed", lambda fn: fn)
    monkeypatch.setattr(suites, "rotating_graph_ms", lambda fns: 0.5 if all(callable(f) for f in fns) else None)


@pytest.mark.skipif(CUDA, reason="runs nvfp4_quantize / nvfp4_matmul through Triton's CPU interpreter")
def test_run_gemm_real_kernels_cpu(cpu_timer):
    lines = []
    rows = suites.run_gemm(GEMM_TINY, out=lines.append)
    json.dumps(rows)
    assert [r["m"] for r in rows] == [1, 17]
    for row in rows:
        m, n, k = row["m"], row["n"], row["k"]
        assert row["flops"] == formulas.gemm_flops(m, n, k)
        assert row["weight_bytes"] == {"tileflash_nvfp4": formulas.nvfp4_weight_bytes(n, k),
                                       "tileflash_nvfp4_graph": formulas.nvfp4_weight_bytes(n, k),
                                       "torch_bf16": formulas.gemm_weight_bytes(n, k, 2),
                                       "torch_bf16_graph": formulas.gemm_weight_bytes(n, k, 2),
                                       "torch_fp8": formulas.gemm_weight_bytes(n, k, 1)}
        assert 0.01 < row["nvfp4_weight_err"] < 0.5  # NVFP4 weights are a visible approximation of bf16 ones
        for name in ("tileflash_nvfp4", "tileflash_nvfp4_graph", "torch_bf16", "torch_bf16_graph"):
            rec = row["backends"][name]
            assert rec["ok"] and rec["max_err"] <= suites.GEMM_TOL[name], (name, rec)
            assert rec["us"] == 500.0
            assert rec["TFLOP/s"] == pytest.approx(formulas.tflops(formulas.gemm_flops(m, n, k), 0.5))
            assert rec["GB/s"] == pytest.approx(formulas.gbps(row["weight_bytes"][name], 0.5))
        assert row["backends"]["tileflash_nvfp4"]["max_err"] < 1e-2  # bf16 rounding only
        fp8 = row["backends"]["torch_fp8"]  # torch 2.13 runs _scaled_mm on CPU; older builds give None
        assert fp8 is None or (fp8["ok"] and 1e-3 < fp8["max_err"] <= 0.1), fp8
        assert row["speedup_bf16"] == pytest.approx(1.0) and row["speedup"] == pytest.approx(1.0)
    table = lines[-1]
    assert table.startswith("GEMM") and "| tf-graph weight GB/s |" in table
    assert [c.strip() for c in table.splitlines()[-2].split("|")[1:3]] == ["17", "64"]


@pytest.mark.skipif(CUDA, reason="runs nvfp4_quantize / nvfp4_matmul through Triton's CPU interpreter")
def test_run_gemm_fp8_failure_and_wrong_tileflash(cpu_timer, monkeypatch):
    import tileflash

    def no_scaled_mm(*args, **kwargs):
        raise RuntimeError("_scaled_mm: no FP8 kernel here")

    real = tileflash.nvfp4_matmul
    monkeypatch.setattr(torch, "_scaled_mm", no_scaled_mm)
    monkeypatch.setattr(tileflash, "nvfp4_matmul", lambda *args: real(*args) * 1.1)
    lines = []
    (row,) = suites.run_gemm(GEMM_TINY[1:], out=lines.append)
    json.dumps(row)
    assert row["backends"]["torch_fp8"] is None  # unavailable: a '-' cell, and the run goes on
    assert any("torch_fp8 failed" in line and "no FP8 kernel" in line for line in lines)
    tf = row["backends"]["tileflash_nvfp4"]
    assert not tf["ok"] and tf["max_err"] == pytest.approx(0.1, rel=0.05) and tf["us"] == 500.0
    assert row["speedup"] is None and row["speedup_bf16"] is None  # a wrong tileflash is never compared
    assert row["backends"]["torch_bf16"]["ok"]
    assert any("FAIL: tileflash_nvfp4" in line for line in lines)
    last = lines[-1].splitlines()[-2]
    assert "tileflash_nvfp4" in last and last.count(" - ") >= 3  # fp8 us, tf/bf16, tf/best


def test_scaled_mm_fp8_peer_layout(monkeypatch):
    """The FP8 peer hands _scaled_mm e4m3 a [M, K], a column-major [K, N] view of w, and fp32 [] scales."""
    seen = {}

    def fake_scaled_mm(a8, b, scale_a, scale_b, out_dtype):
        seen.update(a8=a8, b=b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
        return (a8.float() * scale_a) @ (b.float() * scale_b)

    monkeypatch.setattr(torch, "_scaled_mm", fake_scaled_mm)
    a = torch.randn(3, 32, dtype=torch.bfloat16)
    w = torch.randn(16, 32, dtype=torch.bfloat16) * 100
    fn = peers.scaled_mm_fp8(a, w)
    out = fn()
    assert seen["a8"].dtype == seen["b"].dtype == torch.float8_e4m3fn
    assert seen["b"].shape == (32, 16) and seen["b"].stride() == (1, 32)  # column-major
    assert seen["scale_a"].shape == () and seen["scale_a"].dtype == torch.float32
    assert float(seen["b"].float().abs().max()) == 448.0  # per-tensor amax maps to e4m3's max
    assert seen["out_dtype"] == torch.bfloat16
    assert suites.rel_err(out, a.float() @ w.float().T) < 0.1
    zero = peers.scaled_mm_fp8(torch.zeros(2, 32, dtype=torch.bfloat16), w)  # amax 0: scale 1, no NaN
    assert zero is not None and seen["scale_a"] == 1.0 and not zero().isnan().any()


def test_run_lowp_splits_by_kind(monkeypatch):
    calls = []

    def fake(name):
        def run(shapes, out=print):
            calls.append((name, shapes))
            return [{"from": name, **s} for s in shapes]
        return run

    monkeypatch.setattr(suites, "run_decode", fake("decode"))
    monkeypatch.setattr(suites, "run_gemm", fake("gemm"))
    rows = suites.run_lowp()
    assert calls == [("decode", suites.LOWP_DECODE_SHAPES), ("gemm", suites.GEMM_SHAPES)]
    assert [r["from"] for r in rows] == ["decode"] * 40 + ["gemm"] * 16
    calls.clear()
    assert len(suites.run_lowp(suites.select_shapes(suites.LOWP_SHAPES, only="gemm"))) == 16
    assert [name for name, _ in calls] == ["gemm"]  # no empty decode run (and no empty table)


def test_plot_series_gemm_and_lowp_charts(tmp_path):
    from tileflash.bench import plots

    def rec(tflops):
        return {"TFLOP/s": tflops, "GB/s": 1.0}

    gemm = [{"kind": "gemm", "m": m, "n": 8192, "k": 8192, "label": "gemm-8k",
             "backends": {"tileflash_nvfp4": rec(t), "torch_bf16": rec(2 * t), "torch_fp8": None}}
            for m, t in ((16, 10.0), (4096, 500.0))]
    labels, data = plots.series("lowp", gemm)
    assert labels == ["M16 8k", "M4096 8k"]
    assert data == {"tileflash_nvfp4": [10.0, 500.0], "torch_bf16": [20.0, 1000.0]}
    decode = [{"kind": "decode", "label": "gqa-fp8", "batch": 8, "ctx": 32768,
               "backends": {"tileflash": {"GB/s": 3000.0}, "sdpa": None}}]
    assert plots.series("lowp", decode) == (["gqa-fp8 b8 32k"], {"tileflash": [3000.0]})
    with pytest.raises(ValueError):
        plots.series("lowp", decode + gemm)
    pytest.importorskip("matplotlib")
    paths = plots.write_charts({"lowp": decode + gemm}, str(tmp_path))
    assert [p.rsplit("/", 1)[-1] for p in paths] == ["lowp.png", "lowp-gemm.png"]


def test_flush_flag_defaults_to_do_bench_and_accepts_read():
    from tileflash.bench import cli, timing

    assert cli.build_parser().parse_args(["decode"]).flush == "zero" == timing.flush_mode
    assert cli.build_parser().parse_args(["decode", "--flush", "read"]).flush == "read"
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["decode", "--flush", "none"])


def test_mla_set_and_roofline():
    """The MLA set covers issue 28's grid (H = 16 and 128, b = 1..128, ctx 1k..32k, page 64), and its roofline
    counts 576 x 2 bytes per token and 2 x H x (576 + 512) FLOPs per token and query row."""
    from tileflash.bench import timing

    shapes = suites.MLA_SHAPES
    assert {s["hq"] for s in shapes} == {8, 16, 32, 128} and {s["page_size"] for s in shapes} == {None, 64}
    assert min(s["batch"] for s in shapes) == 1 and max(s["batch"] for s in shapes) == 128
    assert min(s["ctx"] for s in shapes) == 1024 and max(s["ctx"] for s in shapes) == 32768
    assert all(s["label"].startswith(f"mla-h{s['hq']}") for s in shapes)
    assert formulas.mla_decode_bytes(3, 10) == 3 * 10 * 576 * 2
    assert formulas.mla_decode_flops(2, 128, 1, 10) == 2 * 2 * 128 * 10 * (576 + 512)
    assert timing.rotation_copies(10 * 2 ** 20) == 10 and timing.rotation_copies(300 * 2 ** 20) == 2


class _FakeFlashInferMLA:
    """FlashInfer's BatchMLAPagedAttentionWrapper as its documentation defines it, in torch: pages of page_size
    tokens listed per sequence by kv_indptr / kv_indices, kv_len tokens used, scores q_nope . ckv + q_pe . kpe."""

    def __init__(self, workspace, *args, **kwargs):
        self.plan_args = None

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len, num_heads, head_dim_ckv, head_dim_kpe, page_size,
             causal, sm_scale, q_dtype, kv_dtype):
        assert not causal and head_dim_ckv == 512 and head_dim_kpe == 64
        assert qo_indptr.tolist() == list(range(kv_len.numel() + 1))  # one query row per sequence
        self.plan_args = (kv_indptr.tolist(), kv_indices.long(), kv_len.tolist(), num_heads, page_size, sm_scale)

    def run(self, q_nope, q_pe, ckv, kpe):
        indptr, indices, lens, heads, page, scale = self.plan_args
        assert ckv.shape[1:] == (page, 512) and kpe.shape[1:] == (page, 64) and q_nope.shape[1] == heads
        out = torch.empty(q_nope.shape, dtype=q_nope.dtype)
        for b, n in enumerate(lens):
            pages = indices[indptr[b]:indptr[b + 1]]
            c, r = ckv[pages].reshape(-1, 512)[:n].float(), kpe[pages].reshape(-1, 64)[:n].float()
            p = torch.softmax((q_nope[b].float() @ c.T + q_pe[b].float() @ r.T) * scale, dim=-1)
            out[b] = (p @ c).to(out.dtype)
        return out


@pytest.mark.skipif(CUDA, reason="a stand-in for flashinfer on the CPU")
def test_flashinfer_mla_peer_builds_flashinfers_call(monkeypatch, request):
    """bench/peers.flashinfer_mla hands FlashInfer's documented MLA wrapper pages, indices, lengths and scale that
    give the fp32 reference (contiguous caches as 64-token pages, paged pools in random order, FP8 rows dequantized),
    checked through the MLA suite with a torch stand-in for flashinfer."""
    _cpu_timing(monkeypatch)
    fake = types.ModuleType("flashinfer")
    fake.mla = types.SimpleNamespace(BatchMLAPagedAttentionWrapper=_FakeFlashInferMLA)
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    peers._import.cache_clear()  # (cached per process: an earlier suite found no flashinfer)
    request.addfinalizer(peers._import.cache_clear)  # later tests must not find the stand-in
    rows = suites.run_decode([{"kind": "mla", "hq": 16, "batch": 2, "ctx": 128, "page_size": ps, "label": "mla",
                               **({"kv": "fp8"} if fp8 else {})} for ps, fp8 in ((None, False), (32, False),
                                                                                  (None, True))],
                             out=lambda s: None)
    for row in rows:
        rec = row["backends"]["flashinfer_mla_graph"]
        assert rec["ok"] and rec["us"] == 500.0, (row["page_size"], rec)
