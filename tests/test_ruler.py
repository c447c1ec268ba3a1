"""RULER's synthetic tasks: scoring, prompt generation (needles, lengths, determinism, references), the
effective length, the evaluator end to end, and bad input through the command line."""

import json
import re
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from pose_mlx.eval import haystack, longctx, ruler, ruler_tasks as rt
from pose_mlx.errors import UserError

import mlx.core as mx

from _eval_helpers import assert_cost, count_appends, make_eval_folder

NIAH = [t for t in rt.TASKS if t.startswith("niah")]
CHAT_TEMPLATE = ("{% for m in messages %}<s>user: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random 2-layer llama with a 600-piece byte-level BPE tokenizer, window 4096 (plain prompts)."""
    folder = make_eval_folder(tmp_path_factory.mktemp("ruler") / "tiny", max_position_embeddings=4096)
    return folder, longctx.load_eval_model(folder)


@pytest.fixture(scope="module")
def chat_tokenizer(tiny, tmp_path_factory):
    """The same tokenizer with a chat template."""
    import shutil

    folder = tmp_path_factory.mktemp("ruler_chat") / "tiny"
    shutil.copytree(tiny[0], folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return longctx.load_eval_model(folder).tokenizer


@pytest.fixture(scope="module")
def spm_tokenizer(tmp_path_factory):
    """A sentencepiece BPE tokenizer (Llama-style: "▁" word prefix, byte fallback) trained on the essay."""
    from pose_mlx import toy

    folder = toy.make_model_folder(tmp_path_factory.mktemp("ruler_spm") / "spm", vocab_size=1000,
                                   texts=[haystack.reference_text()[:200_000]], max_position_embeddings=4096)
    return longctx.load_eval_model(folder).tokenizer


def body_of(sample: rt.Sample, fmt: rt.PromptFormat) -> str:
    return sample.text[len(fmt.head): len(sample.text) - len(fmt.tail) - len(sample.answer_prefix)]


def haystack_of(sample, fmt) -> str:
    """The lines between the preamble and the question."""
    return body_of(sample, fmt).split("\n", 1)[1].rsplit("\n", 1)[0]


# ------------------------------------------------------------------------------------------------ scoring


@pytest.mark.parametrize("output, references, expected", [
    ("The numbers are 1234567 and 7654321.", ["1234567", "7654321", "1111111"], 2 / 3),
    ("answer: abcde-fghij", ["ABCDE-FGHIJ"], 1.0),  # case-insensitive
    ("ZEBRA, Apple", ["apple", "zebra"], 1.0),
    ("nothing here", ["42"], 0.0),
    ("", ["x"], 0.0),
    ("12345678", ["1234567"], 1.0),  # a substring counts, as in RULER
    ("VAR ABCDE VAR FGHIJ", ["ABCDE", "FGHIJ", "KLMNO", "PQRST"], 0.5),
])
def test_match_all_is_the_fraction_of_references_found(output, references, expected):
    assert ruler.match_all(output, references) == pytest.approx(expected)


def test_match_all_needs_references():
    with pytest.raises(ValueError, match="at least one"):
        ruler.match_all("text", [])


@pytest.mark.parametrize("averages, expected", [
    ({1024: 0.95, 2048: 0.86, 4096: 0.5, 8192: 0.9}, 2048),  # 8192 passes again but 4096 failed before it
    ({1024: 0.5, 2048: 0.95}, None),  # the shortest length already fails
    ({1024: 0.9, 2048: 0.9}, 2048),
    ({4096: 0.856}, 4096),  # at the threshold counts
    ({4096: 0.8559}, None),
    ({1024: float("nan"), 2048: 0.9}, None),
])
def test_effective_length_is_the_end_of_the_passing_run(averages, expected):
    assert ruler.effective_length(averages, 0.856) == expected


def test_run_scores_average_their_records():
    rec = lambda task, length, score: ruler.Record(task, length, 0, length, [], [], ["x"], "", score)
    run = ruler.RulerRun(["a", "b"], [100, 200], [rec("a", 100, 1.0), rec("a", 100, 0.5), rec("b", 100, 0.0),
                                                   rec("a", 200, 1.0), rec("b", 200, 1.0)])
    assert run.score("a", 100) == 0.75
    assert run.averages() == {100: 0.375, 200: 1.0}
    assert run.effective_length(0.3) == 200 and run.effective_length(0.5) is None
    assert {"task": "a", "length": 100, "score": 0.75, "samples": 2} in run.results()


# ---------------------------------------------------------------------------------------------- prompts


@pytest.mark.parametrize("kind", ["bpe", "bpe-chat", "sentencepiece"])
@pytest.mark.parametrize("task", list(rt.TASKS))
def test_prompts_fill_their_length_within_two_percent(tiny, chat_tokenizer, spm_tokenizer, task, kind):
    tok = {"bpe": tiny[1].tokenizer, "bpe-chat": chat_tokenizer, "sentencepiece": spm_tokenizer}[kind]
    chat = kind == "bpe-chat"
    builder = rt.PromptBuilder(tok, samples=3, seed=5)
    for length in (1500, 2048, 4000):
        for index in range(3):
            sample = builder.sample(task, length, index)
            assert 0.98 * length <= len(sample.tokens) <= length, (task, length, len(sample.tokens))
            assert sample.tokens == builder.fmt.encode(sample.text)  # the ids are the text's tokenization
            if chat:
                assert sample.text.startswith("<s>user: ") and "\nassistant: Answer:" in sample.text
                assert sample.tokens[0] == tok.bos_token_id and sample.tokens.count(tok.bos_token_id) == 1
            else:
                assert sample.tokens[0] == longctx.bos_id(tok)
                assert sample.text.endswith(sample.answer_prefix) and "assistant" not in sample.text


def test_a_length_too_short_for_the_template_names_the_task(tiny):
    builder = rt.PromptBuilder(tiny[1].tokenizer, samples=1)
    with pytest.raises(UserError, match="--lengths: 300 tokens is too short for cwe"):
        builder.sample("cwe", 300, 0)


def test_fit_size_finds_the_largest_fitting_size():
    for slope, offset, budget in [(3, 10, 1000), (1, 0, 7), (7, 50, 50), (2.5, 3, 12345)]:
        count = lambda n: int(offset + slope * n)
        n = rt.fit_size(count, budget, 0)
        assert count(n) <= budget < count(n + 1)
        assert rt.fit_size(count, budget, 0, guess=n + 40) == n == rt.fit_size(count, budget, 0, guess=1)
    with pytest.raises(rt.TooShort) as short:  # the fixed part alone, count(low) = 100, exceeds the budget
        rt.fit_size(lambda n: 100 + n, 99, 0)
    assert short.value.tokens == 100


def _noise_units(text: str) -> int:
    return sum(text.count(s) for s in rt.NOISE)


@pytest.mark.parametrize("task", NIAH + ["vt"])
@pytest.mark.parametrize("depths", ["spread", "uniform"])
def test_needles_are_at_their_depths_and_nowhere_else(tiny, task, depths):
    tok = tiny[1].tokenizer
    builder = rt.PromptBuilder(tok, samples=4, seed=1, depth_mode=depths)
    spec = rt.TASKS[task]
    essay = haystack.essay_units(haystack.reference_text())
    for index in range(4):
        sample = builder.sample(task, 2048, index)
        requested = builder.depths(task, 2048, index)
        assert [n.depth for n in sample.needles] == requested and len(requested) == spec.needles
        assert requested == sorted(requested) and all(0.0 <= d <= 1.0 for d in requested)
        context = haystack_of(sample, builder.fmt)
        for needle in sample.needles:
            assert sample.text.count(needle.text) == 1 and sample.text[needle.char:].startswith(needle.text)
            # the needle's first token: the text before it has `token` tokens and lacks it; the needle follows
            ahead = tok.decode(sample.tokens[needle.token: needle.token + len(tok.encode(needle.text)) + 2])
            assert needle.text in ahead and needle.text not in tok.decode(sample.tokens[: needle.token])
            before = context[: context.index(needle.text)]
            for other in sample.needles:
                before = before.replace(other.text, "")
            if spec.haystack == "noise":  # units: the filler sentences, counted independently
                units_before, units = _noise_units(before), _noise_units(context)
                assert units == needle.units
            elif spec.haystack == "essay":  # the haystack is the essay's first sentences, cut at a word
                kept = " ".join(before.split())
                units_before = next(p for p in range(len(essay) + 1) if len(" ".join(essay[:p])) >= len(kept))
                assert " ".join(essay[:units_before]) == kept
                units = needle.units
            else:  # the all-needle haystack: one distractor per line
                units_before = len([line for line in before.split("\n") if line.strip()])
                units = needle.units
            assert abs(units_before - needle.depth * units) <= 1.0, (needle, units_before, units)
        if spec.kind == "niah":  # every value once (in its needle), every asked key in its needles + question
            body = body_of(sample, builder.fmt)
            for ref in sample.references:
                assert body.count(ref) == 1
                assert sum(ref in n.text for n in sample.needles) == 1


def test_spread_depths_cover_zero_to_one(tiny):
    builder = rt.PromptBuilder(tiny[1].tokenizer, samples=5)
    assert [builder.depths("niah_single_1", 1000, i) for i in range(5)] == [[0.0], [0.25], [0.5], [0.75], [1.0]]
    assert builder.depths("niah_multikey_1", 1000, 4) == [0.25, 0.5, 0.75, 1.0]
    assert builder.depths("cwe", 1000, 0) == []
    assert rt.PromptBuilder(tiny[1].tokenizer, samples=1).depths("niah_single_1", 1000, 0) == [0.5]


def test_same_seed_same_prompts_other_seed_other_prompts(tiny):
    tok = tiny[1].tokenizer
    a, b, c = (rt.PromptBuilder(tok, samples=2, seed=s) for s in (7, 7, 8))
    for task in rt.TASKS:
        zero, first = a.sample(task, 2048, 0), a.sample(task, 2048, 1)
        assert zero.tokens != first.tokens
    for task in reversed(rt.TASKS):  # b builds only sample 1, tasks in the other order: no dependence
        first = a.sample(task, 2048, 1)
        assert b.sample(task, 2048, 1).tokens == first.tokens
        other = c.sample(task, 2048, 1)
        assert other.tokens != first.tokens and other.references != first.references


def test_samples_of_a_task_share_the_haystack_before_their_first_needle(tiny):
    builder = rt.PromptBuilder(tiny[1].tokenizer, samples=4)  # single needles at depths 0, 1/3, 2/3, 1
    for task in ("niah_single_1", "niah_single_2", "niah_multikey_2"):
        deep, shallow = builder.sample(task, 2048, 3), builder.sample(task, 2048, 2)
        shared = shallow.needles[0].char
        assert deep.text[:shared] == shallow.text[:shared]
        assert shared > 0.5 * len(shallow.text)


def _resolve_chains(text: str) -> dict[str, str]:
    """Every variable's value, following "VAR X = VAR Y." back to a number (an independent resolver)."""
    direct = dict(re.findall(r"VAR ([A-Z]{5}) = (\d+)\.", text))
    copies = dict(re.findall(r"VAR ([A-Z]{5}) = VAR ([A-Z]{5})\.", text))
    values = dict(direct)
    while len(values) < len(direct) + len(copies):
        progress = {name: values[src] for name, src in copies.items() if name not in values and src in values}
        assert progress, "a chain refers to an unassigned variable"
        values.update(progress)
    return values


def test_variable_tracking_references_are_the_chain_of_the_asked_value(tiny):
    builder = rt.PromptBuilder(tiny[1].tokenizer, samples=6, seed=3)
    for index in range(6):
        sample = builder.sample("vt", 2048, index)
        body = body_of(sample, builder.fmt)
        asked = re.search(r"assigned the value (\d+)", body.rsplit("\n", 1)[1]).group(1)
        values = _resolve_chains(haystack_of(sample, builder.fmt))
        assert len(values) == rt.TASKS["vt"].chains * (rt.TASKS["vt"].hops + 1)
        assert sorted(sample.references) == sorted(v for v, x in values.items() if x == asked)
        assert len(sample.references) == 5 and len(set(values.values())) == rt.TASKS["vt"].chains


@pytest.mark.parametrize("length", [1500, 4096])
def test_frequent_words_references_are_the_three_most_frequent(tiny, length):
    builder = rt.PromptBuilder(tiny[1].tokenizer, samples=3, seed=2)
    for index in range(3):
        sample = builder.sample("fwe", length, index)
        counts = Counter(w for w in haystack_of(sample, builder.fmt).split() if w != "...")
        ranked = counts.most_common()
        assert sorted(sample.references) == sorted(w for w, _ in ranked[:3])
        assert ranked[2][1] > ranked[3][1]  # the top three are unambiguous
        assert all(re.fullmatch(r"[a-z]{6}", w) for w in counts)


@pytest.mark.parametrize("length", [2048, 4096])
def test_common_words_references_are_the_ten_most_repeated(tiny, length):
    builder = rt.PromptBuilder(tiny[1].tokenizer, samples=2, seed=4)
    sample = builder.sample("cwe", length, 1)
    entries = re.findall(r"(\d+)\. (\S+)", haystack_of(sample, builder.fmt))
    assert [int(i) for i, _ in entries] == list(range(1, len(entries) + 1))
    counts = Counter(w for _, w in entries).most_common()
    assert sorted(sample.references) == sorted(w for w, _ in counts[:10])
    assert counts[9][1] > counts[10][1]
    assert all(ref not in w for ref in sample.references for w, _ in counts if w != ref)  # no word inside another


def test_haystack_folder_replaces_the_essay(tiny, tmp_path):
    (tmp_path / "notes.md").write_text("Zebras graze quietly near the riverbank. " * 200)
    (tmp_path / "skip.py").write_text("print('not read')")
    builder = rt.PromptBuilder(tiny[1].tokenizer, samples=1, haystack_dir=tmp_path)
    sample = builder.sample("niah_single_2", 1500, 0)
    assert "Zebras graze quietly near the riverbank." in sample.text and "print" not in sample.text
    code = tmp_path / "code"
    code.mkdir()
    (code / "main.py").write_text("print('not prose')\n" * 100)
    with pytest.raises(UserError, match="--haystack: .*code has no .txt/.md/.rst files"):
        rt.PromptBuilder(tiny[1].tokenizer, samples=1, haystack_dir=code)
    with pytest.raises(UserError, match="--haystack: .*missing is not a folder"):
        rt.PromptBuilder(tiny[1].tokenizer, samples=1, haystack_dir=tmp_path / "missing")


def test_unknown_task_suggests_the_closest():
    with pytest.raises(UserError, match="unknown task 'niah_singel_1'; did you mean 'niah_single_1'"):
        rt.parse_tasks("niah_single_2,niah_singel_1")
    assert rt.parse_tasks("vt, cwe,vt") == ["vt", "cwe"]
    assert rt.parse_tasks("all") == list(rt.TASKS)


# ------------------------------------------------------------------------------------------- evaluation


class NeedleOracle:
    """A stand-in model that answers single-needle prompts from what its KV cache holds.

    Its one cache layer stores the token ids it has seen. It decodes them, takes the key of the last
    "Answer: the special magic ... for KEY is", finds "for KEY is VALUE." before it and emits " VALUE"
    character by character (single characters are single tokens of the byte-level tokenizer), then EOS. A
    cache holding a stale prefix (another sample's needle) makes it answer that sample's value.
    """

    def __init__(self, tokenizer, vocab_size: int):
        self.layers, self.tok, self.vocab_size, self.eos = [None], tokenizer, vocab_size, tokenizer.eos_token_id

    def _next(self, history: list[int]) -> int:
        text = self.tok.decode(history)
        asked = list(re.finditer(r"Answer: the special magic \w+ for (\S+) is", text))
        if not asked:
            return self.eos
        found = re.search(rf"for {re.escape(asked[-1].group(1))} is (\S+)\.", text[: asked[-1].start()])
        target, produced = " " + found.group(1), text[asked[-1].end():]
        if produced == target or not target.startswith(produced):
            return self.eos
        [token] = self.tok.encode(target[len(produced)], add_special_tokens=False)
        return token

    def __call__(self, inputs, cache):
        x = inputs.astype(mx.float32)[:, None, :, None]
        keys, _ = cache[0].update_and_fetch(x, x)
        history = np.array(keys[0, 0, :, 0]).astype(int).tolist()
        logits = np.zeros((1, inputs.shape[1], self.vocab_size), dtype=np.float32)
        logits[0, -1, self._next(history)] = 10.0  # prefill and decoding read the last position only
        return mx.array(logits)


@pytest.mark.parametrize("reuse", [True, False])
def test_a_model_that_reads_its_context_scores_one(tiny, reuse):
    tok = tiny[1].tokenizer
    oracle = NeedleOracle(tok, tiny[1].model.args.vocab_size)
    tasks = ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_2", "niah_multikey_3"]
    run = ruler.run_ruler(oracle, tok, [1500, 2048], tasks, samples=3, seed=0, chunk=256, show_progress=False,
                          reuse=reuse)
    assert len(run.records) == 30 and all(r.score == 1.0 for r in run.records), \
        [(r.references, r.output) for r in run.records if r.score < 1]
    assert run.effective_length() == 2048
    if reuse:
        assert run.computed_tokens < 0.8 * run.prompt_tokens
    else:
        assert run.computed_tokens == run.prompt_tokens


def test_a_random_model_scores_zero_on_every_task(tiny):
    model, tok = tiny[1].model, tiny[1].tokenizer
    run = ruler.run_ruler(model, tok, [1500], "all", samples=2, seed=0, max_new_tokens=16, show_progress=False)
    assert len(run.records) == 2 * len(rt.TASKS)
    assert all(len(r.output) > 0 for r in run.records)  # it answered (junk), it was not cut off
    for result in run.results():
        assert result["score"] <= 0.05, result


def test_evaluation_order_groups_shared_prefixes_deepest_first(tiny):
    builder = rt.PromptBuilder(tiny[1].tokenizer, samples=3)
    tasks = ["niah_single_1", "niah_single_2", "niah_multivalue", "cwe"]
    plan = ruler.evaluation_order(builder, tasks, [1000, 2000], 3)
    assert sorted(plan) == sorted((t, n, i) for t in tasks for n in (1000, 2000) for i in range(3))
    essay = [(t, i) for t, n, i in plan if n == 1000 and t in ("niah_single_2", "niah_multivalue")]
    firsts = [builder.depths(t, 1000, i)[0] for t, i in essay]
    assert firsts == sorted(firsts, reverse=True) and len(essay) == 6
    assert [n for _, n, _ in plan] == sorted(n for _, n, _ in plan)


# ------------------------------------------------------------------------------------------------- CLI


def test_cli_writes_json_heatmap_and_table(tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["--model", str(tiny[0]), "--lengths", "1500,2k", "--tasks", "niah_single_1,vt", "--samples", "2",
            "--max-new-tokens", "4", "--no-progress"]
    started = time.perf_counter()
    assert ruler.main(argv) == 0
    elapsed = time.perf_counter() - started
    captured = capsys.readouterr()
    # the default path, in the model folder's results folder, announced on stderr (-2, ... when an earlier test
    # of the session took the name)
    [announced] = [line for line in captured.err.splitlines() if line.startswith("no --output given: writing ")]
    out = Path(announced.removeprefix("no --output given: writing "))
    assert out.parent == tiny[0] / "eval" and out.name.startswith("ruler-1500_2k-2samples-niah_single_1+vt")
    assert captured.err.splitlines()[-1] == f"wrote {out} and {out.with_name(out.stem + '_heatmap.png')}"
    assert "ruler: 8 samples (2 tasks at 1500, 2048 tokens): 14,192 prompt tokens" in captured.err
    record = json.loads(out.read_text())
    assert out.with_name(out.stem + "_heatmap.png").stat().st_size > 1000
    assert record["lengths"] == [1500, 2048] and record["tasks"] == ["niah_single_1", "vt"]
    assert_cost(record, tiny[0], elapsed)
    assert record["threshold"] == 0.856 and record["effective_length"] is None and not record["chat_template"]
    assert len(record["records"]) == 8 and len(record["results"]) == 4
    for result in record["results"]:
        scores = [r["score"] for r in record["records"]
                  if (r["task"], r["length"]) == (result["task"], result["length"])]
        assert result["samples"] == len(scores) == 2 and result["score"] == pytest.approx(np.mean(scores))
    first = record["records"][0]
    assert {"task", "length", "prompt_tokens", "depths", "needle_tokens", "references", "output", "score"} <= set(first)
    assert "| niah_single_1 | 0.00 | 0.00 |" in captured.out and "| vt |" in captured.out
    assert "effective length: none" in captured.out
    assert not list(tmp_path.glob(".*")) and not list(tmp_path.glob("*.partial.jsonl"))  # no temporary file left


def test_interrupted_run_takes_up_its_finished_samples(tiny, tmp_path, capsys, monkeypatch):
    """Killed after 3 of 8 samples, the same command runs the other 5 and writes what an uninterrupted run
    writes (every record, in the same order)."""
    from pose_mlx.errors import EXIT_INTERRUPTED

    argv = ["--model", str(tiny[0]), "--lengths", "1500,2k", "--tasks", "niah_single_1,vt", "--samples", "2",
            "--max-new-tokens", "4", "--no-progress"]
    assert ruler.main([*argv, "--output", str(tmp_path / "whole.json")]) == 0
    count_appends(monkeypatch, interrupt_after=3)
    out = tmp_path / "r.json"
    assert ruler.main([*argv, "--output", str(out)]) == EXIT_INTERRUPTED
    assert "3 finished samples are kept" in capsys.readouterr().err and not out.exists()
    appended = count_appends(monkeypatch)
    assert ruler.main([*argv, "--output", str(out)]) == 0
    assert "taking up 3 of 8 samples" in capsys.readouterr().err and len(appended) == 5
    whole = json.loads((tmp_path / "whole.json").read_text())
    resumed = json.loads(out.read_text())
    assert resumed["records"] == whole["records"]
    assert resumed["cost"]["taken_up"] == 3 and whole["cost"]["taken_up"] == 0  # whose time `seconds` lacks
    assert not (tmp_path / "r.json.partial.jsonl").exists()


def _fails_cleanly(argv, tmp_path, capsys, monkeypatch, fragment):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out" / "r.json"
    assert ruler.main(argv + ["--output", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("pose_mlx.ruler: error: ") and fragment in err, err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("ruler-*"))


@pytest.mark.parametrize("extra, fragment", [
    (["--tasks", "niah_singel_1"], "did you mean 'niah_single_1'"),
    (["--lengths", "1k;2k"], "--lengths '1k;2k' is not a length"),
    (["--lengths", "16k"], "16384 is beyond the window this model declares, 4096 tokens (its config)"),
    (["--samples", "0"], "--samples: 0 must be >= 1"),
    (["--lengths", "200"], "--lengths: too short for 10 of 11 tasks: niah_single_2 at 200 ("),
    (["--threshold", "1.5"], "--threshold"),
    (["--depths", "middle"], "--depths"),
    (["--haystack", "/nonexistent/texts"], "--haystack"),
])
def test_bad_input_is_one_line_and_writes_nothing(tiny, tmp_path, capsys, monkeypatch, extra, fragment):
    _fails_cleanly(["--model", str(tiny[0]), "--lengths", "1k"] + extra, tmp_path, capsys, monkeypatch, fragment)


def test_model_without_tokenizer_is_one_line(tmp_path, capsys, monkeypatch):
    folder = make_eval_folder(tmp_path / "bare", tokenizer=False)
    _fails_cleanly(["--model", str(folder), "--lengths", "1k"], tmp_path, capsys, monkeypatch, "no tokenizer files")


def test_memory_above_ram_needs_force(tiny, tmp_path, capsys, monkeypatch):
    import pose_mlx.memory as memory

    monkeypatch.setattr(memory.device, "available_memory", lambda: (10_000, "test"))
    _fails_cleanly(["--model", str(tiny[0]), "--lengths", "1k"], tmp_path, capsys, monkeypatch, "--force")


def test_help_lists_every_task(capsys):
    with pytest.raises(SystemExit) as stop:
        ruler.main(["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert "--threshold" in out and "--haystack" in out and "default: every task below" in out
    for task in rt.TASKS:  # each task with its shortest length
        assert re.search(rf"^  {task} +{ruler.MIN_TOKENS[task]}  ", out, re.M), task


def test_every_too_short_length_and_task_named_at_once(tiny, tmp_path, capsys, monkeypatch):
    """One line, exit 2, naming exactly the (task, length) pairs whose prompt does not fit - the pairs found
    by building every sample directly."""
    lengths, tasks = [200, 300, 600, 1024], ["niah_single_1", "niah_multikey_3", "vt", "cwe"]
    builder = rt.PromptBuilder(tiny[1].tokenizer, samples=1)
    expected = {}
    for task in tasks:
        for n in lengths:
            try:
                builder.sample(task, n, 0)
            except rt.PromptTooShort:
                expected.setdefault(task, []).append(n)
    assert expected and len(expected) < len(tasks) and all(max(v) < 1024 for v in expected.values())
    monkeypatch.chdir(tmp_path)
    argv = ["--model", str(tiny[0]), "--lengths", ",".join(map(str, lengths)), "--tasks", ",".join(tasks)]
    assert ruler.main(argv + ["--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"pose_mlx.ruler: error: --lengths: too short for "
                                                         f"{len(expected)} of {len(tasks)} tasks: ")
    named = dict(re.findall(r"(\w+) at ([\d, ]+) \(", err))
    assert {task: [int(n) for n in text.split(", ")] for task, text in named.items()} == expected
    assert not list(tmp_path.iterdir())


def test_min_tokens_of_the_help_are_smollm2s(smollm2):
    """Each task fits exactly from its MIN_TOKENS on with SmolLM2's tokenizer and chat template."""
    builder = rt.PromptBuilder(smollm2[2], samples=1)
    for task, n in ruler.MIN_TOKENS.items():
        builder.sample(task, n, 0)
        with pytest.raises(rt.PromptTooShort, match=f"^--lengths: {n - 8} tokens is too short for {task} ") as short:
            builder.sample(task, n - 8, 0)
        assert short.value.tokens > n - 8  # the fixed part alone is longer than the length asked for


def test_module_entry_point_reports_bad_input_in_one_line(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(ruler.__file__).resolve().parents[1])}  # this checkout's package
    proc = subprocess.run([sys.executable, "-m", "pose_mlx.ruler", "--model", str(tmp_path), "--lengths", "2k,x"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == ("pose_mlx.ruler: error: --lengths 'x' is not a length: use e.g. 32768, 32k, "
                                   "1.5k or 8x")


# ------------------------------------------------------------------------------------------- real model


def test_smollm2_instruct_finds_single_needles_at_1k(smollm2):
    """SmolLM2-135M-Instruct (its chat template, a real tokenizer) retrieves needles from an essay at 1k."""
    _path, model, tokenizer, _config = smollm2
    run = ruler.run_ruler(model, tokenizer, [1024], ["niah_single_2"], samples=4, seed=0, max_new_tokens=12,
                          show_progress=False)
    assert all(0.98 * 1024 <= r.prompt_tokens <= 1024 for r in run.records)
    assert run.score("niah_single_2", 1024) >= 0.75, [(r.references, r.output) for r in run.records]
