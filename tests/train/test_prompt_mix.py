"""The training prompt mix (:mod:`dflash2_gguf.train.prompt_mix`) never holds a benchmark prompt."""

from __future__ import annotations

import collections

import pytest


@pytest.fixture(scope="module")
def bench():
    from dflash2_gguf.train.prompt_mix import benchmark_texts

    return benchmark_texts()


def test_mix_is_disjoint_from_every_benchmark_set(bench):
    """All of GSM8K-train, MBPP's train + validation tasks and the ShareGPT first turns, none of
    GSM8K test, MATH-500,
    HumanEval, MBPP's test tasks or MT-Bench (3 MBPP train tasks repeat a test task's text and
    are dropped)."""
    from dflash2_gguf.train.prompt_mix import benchmark_overlap, prompt_mix

    mix = prompt_mix()
    assert benchmark_overlap([p for _, p in mix], bench) == []
    counts = collections.Counter(f for f, _ in mix)
    assert counts["math"] == 7473 and 455 <= counts["code"] <= 464, counts
    assert 9000 <= counts["chat"] <= 9500, counts  # ShareGPT first turns, filtered and deduplicated
    assert len({p for _, p in mix}) >= len(mix) - 5  # the families do not repeat each other
    assert mix == prompt_mix()  # seeded order
    assert collections.Counter(f for f, _ in mix[:1000])["code"] > 20  # shuffled together


def test_overlap_check_finds_benchmark_prompts(bench):
    """Negative control: a row of each benchmark set, as the benchmark renders it or raw, is found."""
    from dflash2_gguf.bench.prompt_sets import format_turns, load_rows
    from dflash2_gguf.train.prompt_mix import MBPP_TEST_TASK_IDS, benchmark_overlap, family_prompts

    found = []
    for name in ("gsm8k", "math500", "humaneval", "mt-bench"):
        row = load_rows(name)[3]
        found.append(format_turns(name, row)[0])
    test_task = next(r for r in load_rows("mbpp") if r["task_id"] == MBPP_TEST_TASK_IDS[5])
    found += [test_task["text"], "  " + load_rows("gsm8k")[7]["question"].upper() + "\n"]
    assert benchmark_overlap(found, bench) == found
    code = set(family_prompts("code"))
    assert test_task["text"] not in code



def test_sharegpt_first_turns_reads_a_cut_file(tmp_path):
    """The asset is the head of a larger JSON list, cut inside a record: every complete record is
    read, a record that opens with the assistant has no first user turn, the cut one is dropped."""
    import json

    from dflash2_gguf.train.prompt_mix import sharegpt_first_turns

    recs = [{"id": "a_0", "conversations": [{"from": "human", "value": "Plan a trip, please."},
                                            {"from": "gpt", "value": "Sure."}]},
            {"id": "a_1", "conversations": [{"from": "gpt", "value": "(continued)"}]},
            {"id": "b_0", "conversations": [{"from": "human", "value": "Say \"hi\" [twice], {ok}?"}]},
            {"id": "c_0", "conversations": []}]
    whole = json.dumps(recs + [{"id": "d_0", "conversations": [{"from": "human", "value": "lost in the cut"}]}],
                       indent=1)
    cut = tmp_path / "head.json"
    cut.write_text(whole[: whole.index("lost in the") + 4])
    assert sharegpt_first_turns(cut) == ["Plan a trip, please.", 'Say "hi" [twice], {ok}?']
    full = tmp_path / "full.json"
    full.write_text(whole)
    assert sharegpt_first_turns(full)[-1] == "lost in the cut"
    bad = tmp_path / "bad.json"
    bad.write_text('{"id": 1}')
    with pytest.raises(ValueError, match="not a ShareGPT JSON list"):
        sharegpt_first_turns(bad)


def test_skip_and_families_continue_the_mix_without_repeating_a_prompt():
    """`capture --prompts mix --skip N --families F`: the mix past its first N prompts, only the
    families F, in the mix's order; none of the first N (the held-out shards among them) comes
    back; other specs refuse the two options."""
    from dflash2_gguf.train.cli import load_prompt_families
    from dflash2_gguf.train.prompt_mix import prompt_mix

    mix = prompt_mix()
    head = {p for _, p in mix[:2629]}
    prompts, fams = load_prompt_families("mix", skip=2629, families="math,code")
    assert set(fams) == {"math", "code"} and len(prompts) == len(fams)
    assert not head & set(prompts)
    assert list(zip(fams, prompts)) == [(f, p) for f, p in mix[2629:] if f in ("math", "code")]
    assert len(prompts) > 6000  # 7473 math + ~460 code, less the head's
    code, _ = load_prompt_families("mix", 10, skip=2629, families="code")
    assert code == [p for f, p in mix[2629:] if f == "code"][:10]
    with pytest.raises(SystemExit, match="unknown family 'maths'"):
        load_prompt_families("mix", skip=1, families="maths")
    with pytest.raises(SystemExit, match="use --prompts mix"):
        load_prompt_families("gsm8k-train", skip=10)


def test_until_bounds_a_stream_where_the_next_one_begins():
    """`capture --prompts mix --skip N --until M`: the mix's positions [N, M) only, so a stream
    started at N and one started at M (same families) answer every prompt past N once: together
    they are the stream from N with no bound, in order, with nothing twice. A bound not past the
    start, or one on another prompt set, is refused."""
    from dflash2_gguf.train.cli import load_prompt_families
    from dflash2_gguf.train.prompt_mix import prompt_mix

    mix = prompt_mix()
    first, ffams = load_prompt_families("mix", skip=2629, until=12849, families="math,code")
    rest, rfams = load_prompt_families("mix", skip=12849, families="math,code")
    whole, wfams = load_prompt_families("mix", skip=2629, families="math,code")
    assert list(zip(ffams, first)) == [(f, p) for f, p in mix[2629:12849] if f in ("math", "code")]
    assert first + rest == whole and ffams + rfams == wfams
    assert not set(first) & set(rest) and 0 < len(first) < len(whole)
    head, _ = load_prompt_families("mix", until=100)
    assert head == [p for _, p in mix[:100]]
    with pytest.raises(SystemExit, match="--until 2629 must be past --skip 2629"):
        load_prompt_families("mix", skip=2629, until=2629)
    with pytest.raises(SystemExit, match="use --prompts mix"):
        load_prompt_families("gsm8k-train", until=10)


def test_word_math_is_beside_the_mix_and_disjoint_from_every_benchmark_set(bench):
    """`capture --prompts word-math`: the ASDiv / SVAMP / MAWPS word problems, each text once, with
    GSM8K's template, shuffled, family ``word-math``; no benchmark prompt, no prompt of the mix
    (whose order the committed answers are keyed by, and which it leaves as it was)."""
    from dflash2_gguf.bench.prompt_sets import MATH_SUFFIX
    from dflash2_gguf.train.cli import load_prompt_families
    from dflash2_gguf.train.prompt_mix import WORD_MATH, benchmark_overlap, prompt_mix, word_math_mix

    pairs = word_math_mix()
    prompts = [p for _, p in pairs]
    assert len(pairs) == 4975 and {f for f, _ in pairs} == {WORD_MATH}
    assert len(set(prompts)) == len(prompts) and all(p.endswith(MATH_SUFFIX) for p in prompts)
    assert benchmark_overlap(prompts, bench) == []
    assert not set(prompts) & {p for _, p in prompt_mix()}
    assert pairs == word_math_mix()  # seeded order
    for first in ("Seven red apples and two green apples are in the basket. How many apples",  # ASDiv
                  "There are 87 oranges and 290 bananas in Philip's collection. If the bananas",  # SVAMP
                  "Joan found 70 seashells on the beach. she gave Sam some of her seashells. She has 27 seashell left."):
        assert sum(p.startswith(first) for p in prompts) == 1, first  # each source's first row, once
    assert prompts[0].startswith("Mary is baking a cake.")  # shuffled: not ASDiv's first row
    got, fams = load_prompt_families("word-math", 10)
    assert got == prompts[:10] and fams == [WORD_MATH] * 10
    with pytest.raises(SystemExit, match="use --prompts mix"):
        load_prompt_families("word-math", skip=10)


def test_word_math_drops_a_benchmark_question(monkeypatch):
    """Negative control: a GSM8K test question among the word problems is left out."""
    from dflash2_gguf.bench.prompt_sets import load_rows
    from dflash2_gguf.train import prompt_mix

    leak = load_rows("gsm8k")[11]["question"]
    monkeypatch.setattr(prompt_mix, "word_math_problems", lambda: ["Tom has 3 apples. How many?", leak])
    got = [p for _, p in prompt_mix.word_math_mix()]
    assert len(got) == 1 and got[0].startswith("Tom has 3 apples.")
