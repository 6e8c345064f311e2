"""dflash2-gguf bench: dataset table (the authors' templates on the real files), the seeded pick,
MBPP by path, the per-pass statistics, upstream log parsing, and a CLI smoke run on SmolLM2 with
a random DFlash 2 drafter."""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import random
from importlib import resources
from pathlib import Path

import pytest


from dflash2_gguf.bench import cli as bench

MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."


#: sha256 of MBPP's mbpp.jsonl (974 tasks), the file shipped gzip-compressed in dflash2_gguf/data/.
MBPP_SHA256 = "143559fa164408d45cab058238471288b0e447507ce55db3057c56113d9dccb4"


def _mbpp_path(tmp_path: Path) -> Path:
    """The shipped MBPP, decompressed to a plain .jsonl under ``tmp_path`` (checked by its sha256)."""
    data = gzip.decompress(resources.files("dflash2_gguf").joinpath("data", "mbpp.jsonl.gz").read_bytes())
    assert hashlib.sha256(data).hexdigest() == MBPP_SHA256
    path = tmp_path / "mbpp.jsonl"
    path.write_bytes(data)
    return path


# ---------------------------------------------------------------------------- datasets

@pytest.mark.parametrize("name, rows", [("gsm8k", 1319), ("math500", 500), ("humaneval", 164), ("mt-bench", 80)])
def test_dataset_templates_on_real_files(name, rows):
    data = bench.load_rows(name)
    assert len(data) == rows
    r = data[0]
    turns = bench.format_turns(name, r)
    if name == "gsm8k":
        assert turns == [r["question"] + MATH_SUFFIX]
        assert turns[0].endswith("put your final answer within \\boxed{}.")
    elif name == "math500":
        assert turns == [r["problem"] + MATH_SUFFIX]
    elif name == "humaneval":
        assert turns == ["Write a solution to the following problem and make sure that it passes the tests:\n"
                         "```python\n" + r["prompt"] + "\n```"]
    else:
        assert turns == r["turns"] and len(turns) == 2  # MT-Bench: two user turns


def test_seeded_pick_matches_the_authors_shuffle():
    rows = bench.load_rows("gsm8k")
    order = list(range(len(rows)))
    random.Random(42).shuffle(order)
    picked = bench.load_prompts("gsm8k", 3)
    assert picked == [[rows[i]["question"] + MATH_SUFFIX] for i in order[:3]]
    assert bench.load_prompts("gsm8k", 3) == picked  # deterministic


def test_mbpp_by_name_and_by_path(tmp_path, monkeypatch):
    monkeypatch.delenv("DFLASH2_GGUF_MBPP", raising=False)
    path = _mbpp_path(tmp_path)
    rows = bench.load_rows(str(path))
    assert len(rows) == 974 and [r["task_id"] for r in rows] == list(range(1, 975))
    assert bench.load_rows("mbpp") == rows  # the shipped copy, no file outside the package
    by_path = bench.load_prompts(str(path), 4)
    assert all(len(t) == 1 and isinstance(t[0], str) and t[0] for t in by_path)
    # the task text as is, no template
    order = list(range(len(rows)))
    random.Random(42).shuffle(order)
    assert by_path == [[rows[i]["text"]] for i in order[:4]]
    assert bench.load_prompts("mbpp", 4) == by_path
    monkeypatch.setenv("DFLASH2_GGUF_MBPP", str(path))  # another copy, read instead of the shipped one
    assert bench.load_prompts("mbpp", 4) == by_path
    # a sanitized-style file ("prompt" field) and a generic file with "turns"
    (tmp_path / "mbpp_sanitized.jsonl").write_text(json.dumps({"prompt": "Write f.", "text": "x"}) + "\n")
    assert bench.load_prompts(str(tmp_path / "mbpp_sanitized.jsonl")) == [["Write f."]]
    (tmp_path / "mine.jsonl").write_text(json.dumps({"turns": ["a", "b"]}) + "\n")
    assert bench.load_prompts(str(tmp_path / "mine.jsonl")) == [["a", "b"]]
    with pytest.raises(ValueError):
        bench.load_prompts(str(tmp_path / "missing.jsonl"))


# ---------------------------------------------------------------------------- statistics

def test_committed_per_pass():
    # prefill token, then passes committing 3 (2 drafts + bonus), 1, 2, and a last one cut after 2 drafts
    fd = [False, True, True, False, False, True, False, True, True]
    assert bench.committed_per_pass(fd) == [3, 1, 2, 2]
    assert bench.committed_per_pass([False]) == []
    assert bench.committed_per_pass([False, False, False]) == [1, 1]


def test_parse_upstream_logs():
    from benchmarks.upstream_driver import parse_completion, parse_speculative_simple

    log = ("main: encoded   40 tokens in    0.100 seconds, speed:  400.000 t/s\n"
           "main: decoded   65 tokens in    1.300 seconds, speed:   50.000 t/s\n\n"
           "main: n_draft   = 7\nmain: n_predict = 65\nmain: n_drafted = 84\nmain: n_accept  = 40\n")
    r = parse_speculative_simple(log)
    assert (r.n_generated, r.n_drafted, r.n_accepted) == (65, 84, 40)
    assert r.decode_tokens_per_second == 50.0 and math.isclose(r.acceptance_length, 65 / 25)
    c = parse_completion("llama_perf_context_print: prompt eval time =  10.00 ms /  5 tokens (2.00 ms per token, "
                         "500.00 tokens per second)\nllama_perf_context_print:        eval time =  630.00 ms / "
                         "  63 runs   (   10.00 ms per token,   100.00 tokens per second)\n")
    assert (c.n_generated, c.decode_tokens_per_second) == (63, 100.0)
    with pytest.raises(ValueError):
        parse_speculative_simple("nothing")


def test_report_cycle_cost_sums_requests():
    from benchmarks import report as br

    req = [{"base": {"t_total_s": 1.1, "t_prefill_s": 0.1, "n_cycles": 100},
            "spec": {"t_target_s": 2.0, "t_draft_s": 0.5, "t_inject_s": 0.1, "t_sample_s": 0.0, "n_cycles": 50}},
           {"base": {"t_total_s": 0.6, "t_prefill_s": 0.1, "n_cycles": 50},
            "spec": {"t_target_s": 1.0, "t_draft_s": 0.25, "t_inject_s": 0.0, "t_sample_s": 0.05, "n_cycles": 25}}]
    rep = {"config": {"dataset": "gsm8k", "temperature": 0.0}, "requests": req,
           "summary": {"acceptance_length_pooled": 2.6, "decode_speedup": 0.4}}
    k = br.cycle_cost(rep)
    # 1.5 s over 150 one-token passes; 3.0 / 0.75 / 0.15 s over 75 cycles
    assert k["decode"] == pytest.approx(10.0) and k["verify"] == pytest.approx(40.0)
    assert k["draft"] == pytest.approx(10.0) and k["rest"] == pytest.approx(2.0)
    assert k["break_even"] == pytest.approx(5.2) and k["expected"] == pytest.approx(0.5)
    row = br.cost_table([rep]).splitlines()[2]
    assert row == "| gsm8k | 0 | 10.0 | 40.0 | 10.0 | 2.0 | 5.20 | 2.600 | 0.50 | 0.40 |"
    del req[1]["spec"]["t_target_s"]   # a bench.json without timings: no row, no guess
    assert br.cycle_cost(rep) is None and len(br.cost_table([rep]).splitlines()) == 2


def test_report_lossless_table_aligns_echoed_prompts():
    from benchmarks import report as br

    ours = "To solve this problem, we need to add 48 and 24, which gives 72 clips."
    echo = "<|im_start|>user\nNatalia sold clips...<|im_end|>\n<|im_start|>assistant\n"
    assert not br.text_diverges(ours, echo + ours + " [end of text]")
    assert not br.text_diverges(ours, ours[:50])                     # stopped earlier, agrees so far
    assert br.text_diverges(ours, echo + ours.replace("72", "70"))    # departs at the answer
    assert br.text_diverges(ours, "Something else entirely, longer than forty characters.")
    req = [{"base": {"text": ours}, "n_prompt": 90, "first_mismatch": None},
           {"base": {"text": ours + " Done."}, "n_prompt": 250, "first_mismatch": 7}]
    side = [{"upstream_spec": {"text": echo + ours}, "prompt_lookup": {"text": ours}},
            {"upstream_spec": {"text": echo + ours + " Finished."}, "prompt_lookup": {"text": ours + " Done."}}]
    rep = {"config": {"dataset": "gsm8k", "temperature": 0.0}, "summary": {"mismatches": 1},
           "requests": req, "side_by_side": {"requests": side}}
    t1 = dict(rep, config={"dataset": "gsm8k", "temperature": 1.0})
    lines = br.lossless_table([rep, t1]).splitlines()
    assert lines[2:] == ["| gsm8k | 2 | 1/2 | 257 | 1/2 | n/a | n/a | 0/2 |"]
    assert br.departure_context(req[0]) is None and br.departure_context(req[1]) == 257


def test_upstream_flags_sample_like_ours():
    from benchmarks.upstream_driver import _common_flags

    greedy = _common_flags("t.gguf", Path("p.txt"), 16, 0.0, 1, None, 4096)
    sampled = _common_flags("t.gguf", Path("p.txt"), 16, 1.0, 1, 2, 4096)
    assert "--top-k" not in greedy and greedy[greedy.index("--temp") + 1] == "0.0"
    # T>0: no truncation (llama.cpp's defaults are top-k 40, top-p 0.95, min-p 0.05), as bench samples
    assert sampled[sampled.index("--top-k") + 1] == "0" and sampled[sampled.index("--top-p") + 1] == "1.0"
    assert sampled[sampled.index("--min-p") + 1] == "0.0" and sampled[-2:] == ["-t", "2"]


# ---------------------------------------------------------------------------- smoke run

@pytest.mark.native
@pytest.mark.slow
def test_bench_cli_smoke(native_ext, smollm2_gguf, smollm2_drafters, tmp_path):
    from dflash2_gguf.cli import main

    out = tmp_path / "out"
    rc = main(["bench", "-m", str(smollm2_gguf), "-md", str(smollm2_drafters[2]), "--dataset", "gsm8k",
               "--n-prompts", "2", "--max-new-tokens", "16", "--temp", "0", "-t", "1", "--out", str(out),
               "--no-progress", "-fa", "on", "-nr"])
    assert rc == 0
    rep = json.loads((out / "bench.json").read_text())
    c, s = rep["config"], rep["summary"]
    assert c["dataset"] == "gsm8k" and c["n_prompts"] == 2 and c["max_new_tokens"] == 16
    assert c["block_size"] == 8 and c["drafter_version"] == 2 and c["temperature"] == 0
    for key in ("acceptance_length", "acceptance_histogram", "per_position_acceptance", "pos_reached",
                "pos_accepted", "base_tokens_per_second", "spec_tokens_per_second", "speedup",
                "decode_speedup", "mismatches", "n_cycles"):
        assert key in s, key
    assert s["n_requests"] == 2 and len(rep["requests"]) == 2
    assert s["mismatches"] == 0
    assert len(s["per_position_acceptance"]) == 7
    taus = []
    for r in rep["requests"]:
        sp = r["spec"]
        assert r["tokens_equal"] and r["first_mismatch"] is None
        # every run prefills its whole prompt, as a cold run does: no prefix of the warm-up or of
        # the run before it is reused (reuse changes the prefill's kernels and, at near-ties, the text)
        assert r["base"]["n_cached"] == sp["n_cached"] == 0
        assert sp["n_generated"] == r["base"]["n_generated"] <= 16
        # tau = tokens committed by target passes / passes (the prefill's token is not a pass)
        assert sp["n_cycles"] == len(sp["committed"]) > 0
        assert sum(sp["committed"]) == sp["n_generated"] - 1
        assert math.isclose(sp["acceptance_length"], (sp["n_generated"] - 1) / sp["n_cycles"])
        assert sp["acceptance_length"] >= 1.0
        taus.append(sp["acceptance_length"])
    assert math.isclose(s["acceptance_length"], sum(taus) / len(taus))
    assert sum(s["acceptance_histogram"].values()) == s["n_cycles"]
    assert s["base_tokens_per_second"] > 0 and s["spec_tokens_per_second"] > 0 and s["speedup"] > 0
    md = (out / "bench.md").read_text()
    assert "| target + drafter |" in md and "Per-position conditional acceptance" in md
    assert (c["flash_attn"], c["repack"]) == (True, False) and "flash attention on, repack off" in md
    png = (out / "per_position_acceptance.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"

    # BENCHMARKS.md assembly from that run: the summary row carries its figures, the hand-written
    # analysis survives a regeneration
    from benchmarks import report as br

    runs = tmp_path / "runs"
    runs.mkdir()
    (out).rename(runs / "gsm8k-t0")
    (runs / "commands.txt").write_text("dflash2-gguf bench ... --dataset gsm8k\n")
    bm = tmp_path / "BENCHMARKS.md"
    assert br.main(["--runs", str(runs), "--out", str(bm), "--plot", str(tmp_path / "pp.png")]) == 0
    text = bm.read_text()
    row = next(ln for ln in text.splitlines() if ln.startswith("| gsm8k | 0 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2] == "2" and cells[3] == f"{s['acceptance_length']:.3f}" and cells[8] == "0"
    assert cells[6] == f"{s['speedup']:.2f}"
    cost = next(ln for ln in text.split("## Cost of a cycle", 1)[1].splitlines() if ln.startswith("| gsm8k | 0 |"))
    assert cost.split("|")[7].strip() == f"{br.cycle_cost(rep)['break_even']:.2f}"
    assert "dflash2-gguf bench ... --dataset gsm8k" in text and "pp.png" in text
    assert "as many as the adaptive draft length chooses" in text  # the run's default: adaptive on
    assert (tmp_path / "pp.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bm.write_text(text.replace("(to be written after the run)", "Drafting pays on gsm8k.")
                  + "\n## Measured by hand\n\nA table.\n")
    br.main(["--runs", str(runs), "--out", str(bm), "--plot", str(tmp_path / "pp.png")])
    again = bm.read_text()
    assert "Drafting pays on gsm8k." in again and again.endswith("<!-- /analysis -->\n\n## Measured by hand\n\nA table.\n")



@pytest.mark.native
@pytest.mark.slow
def test_bench_sweep_cli_and_report_section(native_ext, smollm2_gguf, smollm2_drafters, tmp_path):
    """bench --sweep: every configuration on the same requests (T = 0: the same tokens), the
    figures in sweep.json, and BENCHMARKS.md's sweep section rewritten alone (--sweeps-only)
    with those figures, the rest of the file kept."""
    from dflash2_gguf.cli import main

    runs = tmp_path / "runs"
    out = runs / "sweep-gsm8k-t0"
    rc = main(["bench", "-m", str(smollm2_gguf), "-md", str(smollm2_drafters[2]), "--dataset", "gsm8k",
               "--n-prompts", "2", "--max-new-tokens", "12", "--temp", "0", "-t", "1", "--out", str(out),
               "--no-progress", "-fa", "on", "-nr", "--sweep"])
    assert rc == 0
    assert not (out / "sweep.json.tmp").exists()
    rep = json.loads((out / "sweep.json").read_text())
    names = [r["name"] for r in rep["rows"]]
    assert names == ["target alone"] + [f"fixed k={k}" for k in range(1, 7)] + ["fixed k=7 (full block)", "adaptive"]
    assert rep["identical"] is True and rep["config"]["n_prompts"] == 2
    # every configuration decoded the same tokens; the target alone and adaptive twice per request
    tokens = {r["tokens"] for r in rep["rows"][1:-1]}
    assert len(tokens) == 1 and rep["rows"][0]["tokens"] == rep["rows"][-1]["tokens"] == 2 * tokens.pop() > 0
    for r in rep["rows"]:
        assert r["tokens_per_second"] > 0 and r["overall_tokens_per_second"] > 0 and r["acceptance_length"] >= 1.0
    assert rep["rows"][0]["acceptance_length"] == 1.0 and rep["rows"][0]["ratio_vs_alone"] == 1.0
    ad = rep["rows"][-1]
    assert math.isclose(rep["adaptive_vs_alone"], ad["tokens_per_second"] / rep["rows"][0]["tokens_per_second"])
    best = max(r["tokens_per_second"] for r in rep["rows"][1:-1])
    assert math.isclose(rep["adaptive_vs_best_fixed"], ad["tokens_per_second"] / best)
    for r in rep["rows"]:  # what each policy did: one k per cycle, never more than its n_max
        assert sum(r["k_hist"]) == r["cycles"] > 0 and r["draft_inject_seconds"] >= 0
    assert rep["rows"][0]["k_hist"] == [rep["rows"][0]["cycles"]] and rep["rows"][0]["draft_inject_seconds"] == 0
    for k, r in enumerate(rep["rows"][1:-1], start=1):
        assert len(r["k_hist"]) - 1 == k and r["drafter_skipped"] == 0 and r["draft_inject_seconds"] > 0
    # issue 43: each context source alone and the mix, beside them, on the same requests (T = 0: same tokens)
    ctx = rep["context_rows"]
    assert [r["name"] for r in ctx] == ["ngram-simple", "ngram-mod", "context drafts (ngram-simple,ngram-mod)",
                                        "mix (default)"]
    for r in ctx:
        assert r["tokens"] == rep["rows"][0]["tokens"] // 2 and r["departed"] == 0 and sum(r["k_hist"]) == r["cycles"]
        assert set(r["sources"]) <= {"draft-dflash", "ngram-simple", "ngram-mod"}
        assert math.isclose(r["ratio_vs_alone"], r["tokens_per_second"] / rep["rows"][0]["tokens_per_second"])
    used = [{src for src, d in r["sources"].items() if d["drafted"]} for r in ctx]
    assert used[0] <= {"ngram-simple"} and used[1] <= {"ngram-mod"}
    assert "draft-dflash" not in used[2] and ctx[2]["draft_inject_seconds"] == 0
    assert rep["mix_vs_alone"] == ctx[3]["ratio_vs_alone"] and rep["context_vs_alone"] == ctx[2]["ratio_vs_alone"]
    for r in rep["rows"][1:]:  # the draft-length rows measure the DFlash drafter alone
        assert {src for src, d in r["sources"].items() if d["drafted"]} <= {"draft-dflash"}

    from benchmarks import report as br

    (runs / "sweep-commands.txt").write_text("dflash2-gguf bench ... --sweep --dataset gsm8k\n")
    bm = tmp_path / "BENCHMARKS.md"
    bm.write_text("# Benchmarks\n\n## Summary\n\nold figures\n")
    for _ in range(2):  # the second rewrite replaces the first section, it does not add one
        assert br.main(["--runs", str(runs), "--out", str(bm), "--sweeps-only"]) == 0
    text = bm.read_text()
    assert text.count(br.SWEEP_START) == 1 and text.endswith("## Summary\n\nold figures\n")
    assert text.index(br.SWEEP_END) < text.index("## Summary")
    row = next(ln for ln in text.splitlines() if ln.startswith("| gsm8k | 0 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2] == "2" and cells[3] == f"{rep['rows'][0]['tokens_per_second']:.1f}"
    assert cells[4:11] == [f"{r['ratio_vs_alone']:.3f}" for r in rep["rows"][1:-1]]
    assert cells[11] == f"**{ad['ratio_vs_alone']:.3f}**" and cells[13] == f"{rep['adaptive_vs_best_fixed']:.3f}"
    assert all(r["departed"] == 0 for r in rep["rows"])  # 12 tokens: within 256 cells, every row exact
    assert cells[-1] == "0 / 0" and "--sweep --dataset gsm8k" in text
    ran = ad["cycles"] - ad["drafter_skipped"]
    assert f"; adaptive: drafter ran in {ran} of {ad['cycles']} cycles, k histogram {{0: {ad['k_hist'][0]}" in text


def _fake_sweep(dataset: str, temperature: float, alone: float, adaptive: float) -> dict:
    """A sweep.json as ``run_sweep`` writes it, with made-up figures (report rendering only)."""
    rows = [dict(name="target alone", tokens_per_second=alone, ratio_vs_alone=1.0, acceptance_length=1.0,
                 overall_ratio_vs_alone=1.0, departed=0)]
    rows += [dict(name=f"fixed k={k}", tokens_per_second=alone / (k + 1), ratio_vs_alone=1 / (k + 1),
                  acceptance_length=1.2, overall_ratio_vs_alone=1 / (k + 1), departed=0) for k in range(1, 8)]
    rows += [dict(name="adaptive", tokens_per_second=alone * adaptive, ratio_vs_alone=adaptive, acceptance_length=1.0,
                  overall_ratio_vs_alone=adaptive, departed=0, seconds=40.0, cycles=3000, k_hist=[2990, 0, 10],
                  drafter_skipped=2980, draft_inject_seconds=0.1)]
    return dict(config=dict(dataset=dataset, n_prompts=30, max_new_tokens=128, temperature=temperature),
                rows=rows, identical=True, adaptive_vs_best_fixed=adaptive * 2, adaptive_vs_alone=adaptive,
                cost_model=dict(verify_ms=[float(r) for r in range(1, 9)], draft_ms=9.0))


def test_sweeps_only_keeps_rows_whose_run_is_gone(tmp_path):
    """--sweeps-only with the runs of one prompt set / T: that row, command and cost-model line are
    rewritten; the rows of the earlier runs, whose folders are gone, stay as they were; the
    order is prompt-set order, then T; a second rewrite changes nothing."""
    from benchmarks import report as br

    def cmd(ds, t):
        return f"dflash2-gguf bench -m t.gguf -md d.gguf --dataset {ds} --temp {t} --sweep --out r/sweep-{ds}-t{t}"

    bm = tmp_path / "BENCHMARKS.md"
    bm.write_text("# Benchmarks\n\n## Summary\n\nold figures\n")
    first = tmp_path / "first"
    for ds, t, ad in (("mbpp", 1, 0.95), ("gsm8k", 0, 1.01)):
        (first / f"sweep-{ds}-t{t}").mkdir(parents=True)
        (first / f"sweep-{ds}-t{t}" / "sweep.json").write_text(json.dumps(_fake_sweep(ds, t, 100.0, ad)))
    (first / "sweep-commands.txt").write_text(cmd("mbpp", 1) + " \n" + cmd("gsm8k", 0) + "\n")
    assert br.main(["--runs", str(first), "--out", str(bm), "--sweeps-only"]) == 0

    second = tmp_path / "second"  # a later session: mbpp T=1 again, and math500 T=0; gsm8k's folder is gone
    for ds, t, ad in (("mbpp", 1, 0.99), ("math500", 0, 1.02)):
        (second / f"sweep-{ds}-t{t}").mkdir(parents=True)
        (second / f"sweep-{ds}-t{t}" / "sweep.json").write_text(json.dumps(_fake_sweep(ds, t, 50.0, ad)))
    (second / "sweep-commands.txt").write_text(cmd("math500", 0) + "\n" + cmd("mbpp", 1) + "\n")
    assert br.main(["--runs", str(second), "--out", str(bm), "--sweeps-only"]) == 0
    text = bm.read_text()
    rows = [ln for ln in text.splitlines() if ln.startswith("| ") and not ln.startswith("| prompt set")]
    assert [r.split("|")[1].strip() for r in rows] == ["gsm8k", "math500", "mbpp"]
    assert "| 100.0 |" in rows[0] and "**1.010**" in rows[0]           # kept from the first run
    assert "| 50.0 |" in rows[1] and "**1.020**" in rows[1]            # new
    assert "| 50.0 |" in rows[2] and "**0.990**" in rows[2] and "0.950" not in text  # replaced
    cmds = text.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert cmds == [cmd("gsm8k", 0), cmd("math500", 0), cmd("mbpp", 1)]
    assert [ln.split(":")[0] for ln in text.splitlines() if ln.startswith("- ") and " T=" in ln] == \
        ["- gsm8k T=0", "- math500 T=0", "- mbpp T=1"]
    assert "1 of the rows come from earlier runs" in text and text.endswith("## Summary\n\nold figures\n")
    policy = ("; adaptive: drafter ran in 20 of 3000 cycles, k histogram {0: 2990, 2: 10}, drafter passes + "
              "feature injection 0.25% of its decode time")
    assert sum(ln.endswith(policy) for ln in text.splitlines()) == 3  # the kept gsm8k line too
    assert br.main(["--runs", str(second), "--out", str(bm), "--sweeps-only"]) == 0
    assert bm.read_text() == text


def test_upstream_build_leaves_the_amx_kernels_out_on_an_amx_cpu(tmp_path, monkeypatch):
    """On a CPU with AMX, upstream's tools are configured without llama.cpp's AMX kernels (they
    crash at the first decode with repacking on: ggml-org/llama.cpp#20824), and binaries that
    still hold them are not reused: the builder rebuilds them."""
    import benchmarks.upstream_driver as ud

    plain = ud.cmake_options(amx_cpu=False)
    assert plain == ud.CMAKE_OPTIONS and not any("amx" in o for o in plain)
    amx = ud.cmake_options(amx_cpu=True)
    assert amx[:len(plain)] == plain
    assert amx[len(plain):] == ("-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
                                "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
    for name, body in zip(ud.TOOLS, (b"\x7fELF ... ggml_backend_amx_mul_mat ...", b"\x7fELF ...")):
        (tmp_path / name).write_bytes(body)
        (tmp_path / name).chmod(0o755)
    monkeypatch.setattr(ud, "cpu_has_amx", lambda: True)
    assert not ud._have_tools(tmp_path)        # one binary has the AMX kernels: rebuild
    (tmp_path / ud.TOOLS[0]).write_bytes(b"\x7fELF ...")
    assert ud._have_tools(tmp_path)
    (tmp_path / ud.TOOLS[0]).write_bytes(b"\x7fELF ... ggml_backend_amx_mul_mat ...")
    monkeypatch.setattr(ud, "cpu_has_amx", lambda: False)
    assert ud._have_tools(tmp_path)            # no AMX on this CPU: the kernels never run
    (tmp_path / ud.TOOLS[1]).unlink()
    assert not ud._have_tools(tmp_path)
