"""The agent-shaped prompt set and the report of benchmarks/agent_bench.py (issue 43, Deliver 5):
no model needed."""

import json
from pathlib import Path

from benchmarks import agent_bench as ab

ROOT = Path(__file__).resolve().parents[2]


def test_prompt_file_kinds_and_shapes():
    rows = [json.loads(ln) for ln in open(ROOT / "data" / "agent" / "agent_prompts.jsonl", encoding="utf-8")]
    kinds = {}
    for r in rows:
        kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
        assert r["messages"][-1]["role"] == "user" and r["turns"] == [r["messages"][-1]["content"]]
    assert set(kinds) == set(ab.KINDS) and all(n >= 6 for n in kinds.values())
    for r in rows:
        if r["kind"] == "code-edit":
            assert 50 <= r["source"]["lines"] <= 200 and "```python" in r["messages"][-1]["content"]
            assert r["source"]["license"] in ("MIT", "BSD-3-Clause", "Apache-2.0")
        if r["kind"] == "json-tool":  # the tool result is valid JSON
            body = r["messages"][-1]["content"].split("```json\n", 1)[1].split("\n```", 1)[0]
            assert isinstance(json.loads(body), dict)
    turns = [r for r in rows if r["kind"] == "transcript"]  # each turn extends the one before
    for a, b in zip(turns, turns[1:]):
        assert b["messages"][:len(a["messages"])] == a["messages"]


def test_pick_rows_spreads_transcript_turns():
    rows = ab.pick_rows(ab.PROMPTS, ["transcript", "prose"], 2)
    ids = [r["id"] for r in rows]
    n_turns = sum(1 for ln in open(ab.PROMPTS, encoding="utf-8") if '"kind": "transcript"' in ln)
    assert ids == ["transcript-0", f"transcript-{n_turns - 1}", "prose-0", "prose-1"]


def _res(backend, tps_by_prompt, **extra):
    pp = [dict(id=i, kind=i.split("-")[0], decode_tokens=100, decode_seconds=100 / t, n_prompt=-1, n_prompt_ids=10,
               identical_to_target=True, identical_to_ours_target=True) for i, t in tps_by_prompt.items()]
    tok = sum(p["decode_tokens"] for p in pp)
    sec = sum(p["decode_seconds"] for p in pp)
    kinds = {p["kind"]: dict(decode_tokens=100, decode_seconds=p["decode_seconds"], tokens_per_second=100 / p["decode_seconds"])
             for p in pp}
    if "cycles" in extra:
        extra["tau"] = tok / extra["cycles"]
    return dict(backend=backend, all=dict(decode_tokens=tok, decode_seconds=sec, tokens_per_second=tok / sec, **extra),
                kinds=kinds, per_prompt=pp, identical=True, n_prompt_mismatch=0)


def test_report_ratios_and_section(tmp_path):
    rep = dict(config=dict(target="/x/t.gguf", drafter=None, threads=2, n_new=8, n_ctx=64, kinds=["code", "prose"],
                           n_per_kind=1, rows=["code-0", "prose-0"], date="d", machine="m", command="c",
                           bench_seconds=60.0),
               results={"target alone": _res("ours", {"code-0": 10.0, "prose-0": 10.0}, cycles=200),
                        "context drafts": _res("ours", {"code-0": 40.0, "prose-0": 10.0}, cycles=100),
                        "llama.cpp none": _res("llama-server", {"code-0": 10.0, "prose-0": 10.0}),
                        "llama.cpp ngram-mod": _res("llama-server", {"code-0": 20.0, "prose-0": 10.0})})
    assert ab.ours_default(rep) == "context drafts" and ab.best_llama(rep) == "llama.cpp ngram-mod"
    assert abs(ab.geomean_speedup(rep, "context drafts") - 2.0) < 1e-9
    md = ab.model_markdown(rep)
    row = next(ln for ln in md.splitlines() if ln.startswith("| **context drafts**"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "16.0" and cells[2] == "1.60x" and cells[3] == f"{16.0 / (200 / 15):.2f}x" and cells[4] == "2.00x"
    bm = tmp_path / "BENCHMARKS.md"
    bm.write_text("# Benchmarks\n\n## Other\n\ntext\n")
    for _ in range(2):  # the second rewrite replaces the section
        ab.replace_section(bm, ab.report_section([rep], None, "notes"))
    text = bm.read_text()
    assert text.count(ab.SECTION_START) == 1 and text.startswith("# Benchmarks\n\n## Other\n\ntext\n")
    assert "our default (context drafts) / target alone = 1.600" in text
