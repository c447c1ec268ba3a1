"""The simulator (`python -m pose_mlx.sim`): --quick end to end, resume, and its parts against hand-made cases.

Runtime: ~30-45 s on 2 cores (the --quick pipeline fresh, fully cached, and stopped twice by a signal).
"""

import io
import json
import shutil
import os
import re
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from pose_mlx.errors import UserError
from pose_mlx.training.data import TokenizedCorpus
from pose_mlx.sim import __main__ as sim
from pose_mlx.sim import claims
from pose_mlx.sim.config import matched_base, parse_config
from pose_mlx.sim.corpus import split_documents
from pose_mlx.sim.pretrain import block_corpus
from pose_mlx.sim.stages import Stages


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("sim")
    assert sim.main(["--quick", "--prose", "auto", "--out", str(out)]) == 0
    return out


def test_quick_writes_report_results_and_plots(quick):
    report = (quick / "report.md").read_text()
    results = json.loads((quick / "results.json").read_text())
    for png in ("ppl_main", "ppl_schedules", "ppl_chunks", "ppl_content", "passkey", "cost_seconds", "cost_peak"):
        assert (quick / f"{png}.png").stat().st_size > 1000
        assert f"({png}.png)" in report
    assert "## Claims" in report and "## The base model" in report
    from pose_mlx.sim.corpus import DEFAULT_PROSE

    if DEFAULT_PROSE.is_dir():  # installed by .ci/run: --prose auto mixes the reST prose in
        assert results["corpus"]["prose"] == str(DEFAULT_PROSE)
        assert any(".. " in (quick / "corpus" / "train" / f).read_text()[:20000]
                   for f in sorted(p.name for p in (quick / "corpus" / "train").iterdir()))
    gates = results["gates"]
    assert gates["passkey_at_lc"] is None and "not testable" in report
    # a trained model is better than its own no-context guess, which is close to the text's unigram model
    assert results["pretrain"]["val_ppl"] < gates["no_context_ppl"] and gates["unigram_ppl"] > 1
    far, c = gates["far_attention"], results["config"]
    queries = np.arange(c["target"] - c["window"] // 2, c["target"])
    assert far["uniform_share"] == pytest.approx(np.mean((queries + 1 - c["window"]) / (queries + 1)))
    assert 0 < far["far_share"] < 1 and "tokens >= Lc back" in (quick / "report.md").read_text()
    assert 0 < gates["sink_share"] < 1
    assert results["unigram_ppl"] == gates["unigram_ppl"] and results["config"]["eval_stride"] == 16
    # the RULER subset: the scores of pose_mlx.ruler's own JSON, at the lengths each task fits
    assert set(results["ruler"]) == {"original", "pose-linear", "pose-yarn"} and "### RULER subset" in report
    for name, tasks in results["ruler"].items():
        for task, scores in tasks.items():
            own = json.loads((quick / "eval" / f"{name}.ruler.{task}.json").read_text())["results"]
            assert scores == {str(r["length"]): r["score"] for r in own}
    assert results["ruler"]["original"]["niah_single_1"]  # the single needle fits from 128 tokens at toy size
    assert [c["id"] for c in results["claims"]] == list("abcdef")
    assert results["passkey_template_tokens"] > results["config"]["window"]  # toy size: no passkey at Lc
    for claim in results["claims"]:
        if claim["id"] == "c":  # it needs the base's passkey at Lc
            assert claim["held"] is None and "does not fit" in claim["detail"]
            assert "(c) " + claim["claim"] + ": not evaluated" in report
            continue
        assert claim["held"] in (True, False), claim  # every other claim is evaluated at toy size too
        assert re.search(r"\d", claim["detail"])
        verdict = "**held**" if claim["held"] else "**did not hold**"
        assert f"({claim['id']}) {claim['claim']}: {verdict}" in report


def test_quick_numbers_come_from_the_evaluators_and_finetune(quick):
    results = json.loads((quick / "results.json").read_text())
    c = results["config"]
    assert c["lengths"] == [c["window"] * 2**k for k in range(4)] and c["target"] == 8 * c["window"]
    for name, run in results["runs"].items():
        ppl = json.loads((quick / "eval" / f"{name}.ppl.json").read_text())["results"]
        assert run["ppl"] == {str(r["length"]): r["ppl"] for r in ppl}
        if run["spec"]["sampler"] == "plain":  # the adapt-* controls: one ordinary fine-tuning, extended at load
            schedule = json.loads((quick / "runs" / "adapt" / "pose_mlx.json").read_text())["schedule"]
            assert schedule["schedule"] == "none" and schedule["target"] == c["target"]
            assert json.loads((quick / "eval" / f"{name}.ppl.json").read_text())["schedule"] == \
                f"{run['spec']['scaling']} x8 (--schedule, after plain fine-tuning)"
            continue
        schedule = json.loads((quick / "runs" / name / "pose_mlx.json").read_text())["schedule"]
        assert schedule["schedule"] == run["spec"]["scaling"] and schedule["target"] == c["target"]
        if name == "pose-yarn-notemp":  # PoSE + YaRN with its frequencies only
            assert schedule["params"] == {"attention_factor": 1.0} and run["spec"]["params"] == "attention_factor=1"
    # same tokens per update: full_batch sequences of Lt tokens or full_batch * Lt / Lc of Lc tokens (L-1 targets each)
    assert results["runs"]["full-linear"]["cost"]["tokens_per_step"] == c["full_batch"] * (c["target"] - 1)
    assert results["runs"]["pose-linear"]["cost"]["tokens_per_step"] == \
        c["full_batch"] * c["target"] // c["window"] * (c["window"] - 1)
    assert results["runs"]["original"]["cost"] is None  # --method none: no training
    # the controls train like PoSE (same data, updates, tokens per update) with positions 0..Lc-1, one folder
    assert results["runs"]["adapt-yarn"]["cost"] == results["runs"]["adapt-dynamic"]["cost"]
    assert results["runs"]["adapt-yarn"]["cost"]["tokens_per_step"] == results["runs"]["pose-linear"]["cost"][
        "tokens_per_step"]
    assert "sim_agreement" in results and "## Agreement with the real model" in (quick / "report.md").read_text()
    # cost runs: the paper's setting, full_batch sequences per update for both methods (L-1 targets each)
    for method, length in (("pose", lambda target: c["window"]), ("full", lambda target: target)):
        table = results["cost_vs_target"][method]
        assert sorted(table, key=int) == [str(c["window"] * f) for f in (2, 4, 8)]
        for target, row in table.items():
            assert row["tokens_per_step"] == c["full_batch"] * (length(int(target)) - 1)


def test_quick_seeds_intervals_and_position_curves(quick):
    results = json.loads((quick / "results.json").read_text())
    c = results["config"]
    assert c["seeds"] == [0, 1]
    expected = {"original", "randpos-linear", "pose-linear-n1", "pose-linear-n3"} | {
        f"{m}-{s}" for m in ("only", "pose", "full") for s in ("linear", "ntk", "yarn")}
    assert expected <= set(results["runs"]) and set(results["ppl"]) == set(results["runs"])
    assert results["passkey"] == {n: r["passkey"] for n, r in results["runs"].items() if r["passkey"]}
    for name, table in results["ppl"].items():
        for length, row in table.items():
            assert row["values"][0] == results["runs"][name]["ppl"][length]  # seed 0 is the run's own number
            if name in sim.SEEDED:  # the second seed's own evaluation, and the t interval over the two
                own = json.loads((quick / "eval" / f"{name}.s1.ppl.json").read_text())["results"]
                assert row["values"][1] == {str(r["length"]): r["ppl"] for r in own}[length]
                assert row["mean"] == pytest.approx(sum(row["values"]) / 2)
                assert row["ci95"] == pytest.approx(12.706 * abs(row["values"][0] - row["values"][1]) / 2)
            else:
                assert row["values"] == [row["mean"]] and row["ci95"] is None
    # every method's fine-tuning data: the training files and its retrieval documents
    nll = results["nll_by_position"]
    assert set(nll) == set(results["runs"])
    for curve in nll.values():
        assert curve["positions"][0] == 1 and len(curve["positions"]) == len(curve["nll"]) == c["target"] // (
            c["window"] // 4)
        assert curve["windows"] >= 1 and all(np.isfinite(curve["nll"]))
    assert (quick / "nll_by_position.png").stat().st_size > 1000
    assert "(nll_by_position.png)" in (quick / "report.md").read_text()


def test_quick_rerun_resumes_from_cache(quick, capsys):
    before = json.loads((quick / "results.json").read_text())
    assert sim.main(["--quick", "--prose", "auto", "--out", str(quick)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert lines and all(line.endswith(": cached") for line in lines)
    after = json.loads((quick / "results.json").read_text())
    assert after["runs"] == before["runs"] and after["claims"] == before["claims"]
    # the whole run's cost survives the rerun: every stage timed once, by the invocation that ran it
    assert after["stage_seconds"] == before["stage_seconds"] and after["stages_without_time"] == []
    assert after["wall_seconds_this_process"] < before["wall_seconds_this_process"]
    assert after["wall_seconds"] >= sum(after["stage_seconds"].values()) > after["wall_seconds_this_process"]


def test_a_signal_stops_the_run_in_one_line_and_the_rerun_takes_up_where_it_stopped(quick, tmp_path, monkeypatch,
                                                                                     capsys):
    """SIGTERM during pre-training, then during a fine-tuning stage: one line on stderr and exit code 143 each time,
    no traceback; the rerun resumes both from their checkpoints and ends with the uninterrupted run's numbers."""
    from pose_mlx.training import loop

    out, append = tmp_path / "sim", loop.append_log
    target, pretrain_steps, after_stop = {"stage": None}, [], []

    def append_then_signal(log, record):  # the loop's per-step log line: the signal lands mid-training
        append(log, record)
        stage = "finetune" if (out / "pretrained" / "pretrain.json").is_file() else "pretrain"
        if stage == "pretrain":
            pretrain_steps.append(record["step"])
        elif after_stop == [None]:  # the first fine-tuning step after the stop: the stopped run's next one
            after_stop[0] = record["step"]
        if stage == target["stage"] and record["step"] == 2:
            target["stage"] = None
            if stage == "finetune":
                after_stop.append(None)
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(loop, "append_log", append_then_signal)
    argv = ["--quick", "--prose", "auto", "--out", str(out)]
    for stage, last_line in (("pretrain", r"pose_mlx\.sim: stopped: pre-training stopped by SIGTERM; checkpoint saved "
                                          r"at step 2; rerun the same command to resume"),
                             ("finetune", r"pose_mlx\.sim: stopped: fine-tuning of \S+ stopped by a signal; rerun the "
                                          r"same command to resume")):
        target["stage"] = stage
        assert sim.main(argv) == 128 + signal.SIGTERM
        err = capsys.readouterr().err
        assert "Traceback" not in err and re.fullmatch(last_line, err.splitlines()[-1]), err
    assert sim.main(argv) == 0
    assert pretrain_steps == list(range(1, len(pretrain_steps) + 1))  # each step once: resumed, not restarted
    assert after_stop == [3]
    for name in ("pretrained/model.safetensors", "gates.json"):
        assert (out / name).read_bytes() == (quick / name).read_bytes(), name
    ours, theirs = (json.loads((folder / "results.json").read_text()) for folder in (out, quick))
    assert ours["ppl"] == theirs["ppl"] and ours["passkey"] == theirs["passkey"]


def _invented_language(rng, words: int) -> str:
    """Sentences of an invented language (seeded): no file of the default corpus looks like it."""
    syllables = ["ka", "lo", "mi", "ra", "te", "su", "ni", "po", "ve", "da", "zu", "fe", "sho", "qui"]
    lexicon = ["".join(rng.choice(syllables, size=rng.integers(1, 4))) for _ in range(300)]
    out = []
    for _ in range(words // 8):
        sentence = " ".join(rng.choice(lexicon, size=rng.integers(4, 12)))
        out.append(sentence.capitalize() + ".")
    return " ".join(out)


@pytest.fixture(scope="module")
def invented_library(tmp_path_factory):
    """A folder as another language's library or a book collection looks: any suffix or none, nested folders,
    plus a binary file, a Latin-1 file and a hidden folder that must not be read."""
    root = tmp_path_factory.mktemp("library")
    rng = np.random.default_rng(7)
    (root / "lib" / "sub").mkdir(parents=True)
    names = ["lib/Alpha.pm", "lib/sub/beta.rb", "README", "chapter_01.txt", "lib/gamma.c", "notes.rst"]
    for i in range(24):
        name = names[i] if i < len(names) else f"lib/sub/part{i:02d}.pm"
        (root / name).write_text(_invented_language(rng, 6000 if i < 2 else 1200), encoding="utf-8")
    (root / "logo.bin").write_bytes(b"\x89PNG\x00\x01")
    (root / "latin1.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    (root / ".git").mkdir()
    (root / ".git" / "config").write_text(_invented_language(rng, 100))
    return root


def test_a_base_made_alike_replaces_the_pre_training(quick, tmp_path, capsys):
    """--pretrained: a base made with the same settings on the same corpus is copied in, not re-trained; one made
    otherwise is a one-line error (exit 2); the shipped base, made otherwise, leaves the run to pre-train."""
    out = tmp_path / "again"
    assert sim.main(["--quick", "--prose", "auto", "--out", str(out), "--pretrained", str(quick / "pretrained")]) == 0
    assert "pretrain: the base in" in capsys.readouterr().out
    assert not (out / "pretrained.partial").exists()
    assert (out / "pretrained" / "model.safetensors").read_bytes() == (quick / "pretrained" /
                                                                        "model.safetensors").read_bytes()
    record = json.loads((out / "pretrained" / "pretrain.json").read_text())
    assert record.pop("reused_from") == str(quick / "pretrained")
    assert record == json.loads((quick / "pretrained" / "pretrain.json").read_text())
    assert json.loads((out / "gates.json").read_text()) == json.loads((quick / "gates.json").read_text())
    results = json.loads((out / "results.json").read_text())
    assert "pretrain" not in results["stage_seconds"] and results["stages_without_time"] == []
    assert f"copied from `{quick / 'pretrained'}`" in (out / "report.md").read_text()
    made = json.loads((quick / "pretrained" / "pretrain.json").read_text())["made_with"]
    assert made["settings"]["hidden"] == 32 and len(made["corpus"]) == 64

    other = tmp_path / "other"
    assert sim.main(["--quick", "--prose", "auto", "--hidden", "48", "--out", str(other),
                     "--pretrained", str(quick / "pretrained")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"pose_mlx.sim: error: --pretrained {quick / 'pretrained'}: it was made with hidden = 32, "
                   "this run has 48"]
    assert not (other / "pretrained").exists()
    assert sim.main(["--quick", "--pretrained", str(tmp_path / "missing"), "--out", str(other)]) == 2
    assert capsys.readouterr().err.startswith(f"pose_mlx.sim: error: --pretrained {tmp_path / 'missing'}: not a")


def test_corpus_fingerprint_is_the_content_not_the_place(tmp_path):
    from pose_mlx.sim.pretrain import corpus_fingerprint

    for name in ("a", "b"):
        (tmp_path / name / "train").mkdir(parents=True)
        (tmp_path / name / "train" / "00000.txt").write_text("some text")
        (tmp_path / name / "corpus.json").write_text("{}")
    assert corpus_fingerprint(tmp_path / "a") == corpus_fingerprint(tmp_path / "b")
    (tmp_path / "b" / "train" / "00000.txt").write_text("some text!")
    assert corpus_fingerprint(tmp_path / "a") != corpus_fingerprint(tmp_path / "b")
    (tmp_path / "b" / "train" / "00000.txt").rename(tmp_path / "b" / "train" / "00001.txt")
    (tmp_path / "b" / "train" / "00001.txt").write_text("some text")
    assert corpus_fingerprint(tmp_path / "a") != corpus_fingerprint(tmp_path / "b")


def test_corpus_reads_every_text_file_whatever_its_name(invented_library):
    from pose_mlx.sim.corpus import corpus_files

    files = corpus_files(invented_library)
    names = {str(p.relative_to(invented_library)) for p in files}
    assert {"lib/Alpha.pm", "lib/sub/beta.rb", "README", "lib/gamma.c", "logo.bin"} <= names
    assert not any(n.startswith(".git") for n in names) and len(files) == 26  # 24 texts + binary + Latin-1


def test_quick_runs_end_to_end_on_another_corpus(invented_library, tmp_path):
    out = tmp_path / "sim"
    assert sim.main(["--quick", "--corpus", str(invented_library), "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    corpus = results["corpus"]
    assert corpus["source"] == str(invented_library) and corpus["prose"] is None
    assert sum(corpus["documents"].values()) == 24 and corpus["skipped_files"] == {"binary": 1, "encoding": 1}
    assert {c["id"] for c in results["claims"]} == {"a", "b", "c", "d", "e", "f"}
    assert results["ppl"]["original"] and (out / "report.md").is_file()
    train = " ".join(p.read_text() for p in sorted((out / "corpus" / "train").iterdir()))
    assert "def " not in train and "import" not in train  # nothing of the default corpus


def test_reuse_results_runs_only_what_the_earlier_run_lacks(quick, tmp_path, capsys):
    """--reuse-results: an earlier results.json without a run (as before the run joined the grid) gives the same
    results, with only that run's stages run; one made with other settings is refused in one line."""
    before = json.loads((quick / "results.json").read_text())
    prior = json.loads(json.dumps(before))
    for key in ("runs", "ppl", "passkey", "nll_by_position"):
        del prior[key]["pose-yarn-notemp"]
    prior["stage_seconds"] = {k: v for k, v in prior["stage_seconds"].items() if not k.endswith("pose-yarn-notemp")}
    (tmp_path / "prior").mkdir()
    path = tmp_path / "prior" / "results.json"
    path.write_text(json.dumps(prior))
    for png in quick.glob("passkey_heatmap_*.png"):  # the heatmaps that sit next to an earlier run's results
        shutil.copyfile(png, tmp_path / "prior" / png.name)
    out, base = tmp_path / "again", ["--pretrained", str(quick / "pretrained")]
    capsys.readouterr()
    assert sim.main(["--quick", "--prose", "auto", "--out", str(out), *base, "--reuse-results", str(path)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    ran = {line.split("] ", 1)[1].split(":")[0] for line in lines if line.endswith(": running")}
    assert ran == {"corpus", "gates", "finetune data 32", "finetune data 256", "finetune pose-yarn-notemp",
                   "evaluate pose-yarn-notemp", "nll pose-yarn-notemp"}
    assert sum(line.endswith(f": taken from {path}") for line in lines) > 50
    after = json.loads((out / "results.json").read_text())
    for key in ("ppl", "passkey", "nll_by_position", "ruler", "cost_vs_target", "claims", "gates"):
        assert after[key] == before[key], key
    assert list(after["runs"]) == list(before["runs"])  # the grid's order, the new run in its place
    new, old = after["runs"].pop("pose-yarn-notemp"), before["runs"].pop("pose-yarn-notemp")
    assert after["runs"] == before["runs"]  # taken as they were
    timing = ("seconds_per_step", "peak_memory_gb")  # the re-run run's measured cost may differ, nothing else
    assert {k: v for k, v in new["cost"].items() if k not in timing} == {
        k: v for k, v in old["cost"].items() if k not in timing}
    assert {k: v for k, v in new.items() if k != "cost"} == {k: v for k, v in old.items() if k != "cost"}
    assert set(after["stage_seconds"]) == set(before["stage_seconds"])  # reused stages keep their recorded time
    for stage in ("finetune pose-linear", "corpus", "gates"):  # the gates re-ran here, to check them: same time
        assert after["stage_seconds"][stage] == before["stage_seconds"][stage]
    assert "reuse_results" not in after["config"] and after["config"] == before["config"] | {"out": str(out),
                                                                                 "pretrained": base[1]}
    heatmap = "passkey_heatmap_pose-yarn.png"
    assert (out / heatmap).read_bytes() == (quick / heatmap).read_bytes()
    assert sim.main(["--quick", "--prose", "auto", "--seeds", "1", "--out", str(tmp_path / "other"), *base,
                     "--reuse-results", str(path)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"pose_mlx.sim: error: --reuse-results {path}: made with other settings (seeds)"]


def test_bad_corpus_is_one_line_and_exit_2(tmp_path, capsys):
    assert sim.main(["--quick", "--corpus", str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pose_mlx.sim: error: --corpus") and "no such file" in err[0]
    assert sim.main(["--quick", "--window", "0", "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.strip().startswith("pose_mlx.sim: error: --window")


def test_split_documents_by_length_and_seed():
    texts = ["x" * n for n in (5, 50, 7, 40, 3, 9, 8, 6, 4, 2, 1, 30)]
    parts = split_documents(texts, test_docs=3, val_fraction=0.2, seed=0)
    assert parts["test"] == ["x" * 50, "x" * 40, "x" * 30]
    assert len(parts["val"]) == 2 and len(parts["train"]) == 7  # round(0.2 * 9)
    assert sorted(parts["train"] + parts["val"] + parts["test"]) == sorted(texts)
    assert split_documents(texts, 3, 0.2, seed=0) == parts
    with pytest.raises(ValueError, match="test_docs"):
        split_documents(texts[:4], 3, 0.2, 0)


def test_block_corpus_cuts_consecutive_blocks():
    tokens = np.arange(23, dtype=np.int32)
    offsets = np.array([0, 10, 13, 23])  # documents of 10, 3 and 10 tokens
    corpus = TokenizedCorpus(tokens, offsets, np.arange(3), "fp")
    blocks = block_corpus([corpus], 4)
    assert [list(blocks.doc(i)) for i in range(blocks.num_docs)] == [
        [0, 1, 2, 3], [4, 5, 6, 7], [13, 14, 15, 16], [17, 18, 19, 20]]
    first = block_corpus([corpus, corpus], 4, [None, 1])
    assert first.num_docs == 6 and list(first.doc(5)) == [13, 14, 15, 16]
    with pytest.raises(ValueError, match="window"):
        block_corpus([corpus], 1)


def test_every_block_starts_with_bos():
    """With bos: a document's own BOS is dropped and each block is BOS + the next window - 1 tokens."""
    tokens = np.array([1, 10, 11, 12, 13, 14, 15, 16, 1, 20, 21, 22, 23], dtype=np.int32)
    corpus = TokenizedCorpus(tokens, np.array([0, 8, 13]), np.arange(2), "fp")
    blocks = block_corpus([corpus], 4, bos=1)
    assert [list(blocks.doc(i)) for i in range(blocks.num_docs)] == [
        [1, 10, 11, 12], [1, 13, 14, 15], [1, 20, 21, 22]]
    assert block_corpus([corpus], 4).fingerprint != blocks.fingerprint


def test_config_base_matches_llama2_ratio_and_validates():
    assert matched_base(128) == pytest.approx(10_000 * 128 / 4096)  # 4096 / (2 pi 1e4) = 128 / (2 pi b)
    config = parse_config([])
    assert (config.window, config.target, config.base, config.window_batch) == (128, 1024, 312.5, 32)
    assert parse_config(["--quick"]).out == "out/sim-quick"
    assert parse_config([]).prose == "none"  # with the prose the default base fails its passkey gate
    with pytest.raises(UserError, match="--prose"):
        parse_config(["--prose", "/no/such/folder"])
    from pose_mlx.sim.corpus import DEFAULT_PROSE, resolve_prose

    assert resolve_prose("none", None) is None and resolve_prose("auto", "/some/corpus") is None
    assert resolve_prose("auto", None) == (DEFAULT_PROSE if DEFAULT_PROSE.is_dir() else None)
    assert resolve_prose("/x/docs", None) == Path("/x/docs")
    with pytest.raises(UserError, match="--retrieval-fraction"):
        parse_config(["--retrieval-fraction", "1"])
    with pytest.raises(UserError, match="--test-tokens"):
        parse_config(["--test-tokens", "1000"])


def _results(ppl: dict, cost=None, passkey=None) -> dict:
    names = set(ppl) | set(passkey or {})
    runs = {name: {"ppl": {str(k): v for k, v in ppl.get(name, {}).items()}, "passkey": (passkey or {}).get(name, {})}
            for name in names}
    return {"config": {"lengths": [4, 8]}, "runs": runs, "cost_vs_target": cost or {}}


def test_claims_follow_their_thresholds():
    both = {4: 10.0, 8: 10.0}
    r = _results({"original": {4: 10.0, 8: 120.0}, "pose-linear": {4: 10.4, 8: 10.0}, "full-linear": both,
                  "pose-ntk": {4: 9.6, 8: 10.0}, "full-ntk": both, "pose-yarn": both, "full-yarn": both})
    assert claims.claim_a(r, [4, 8])["held"] and claims.claim_b(r, [4, 8])["held"]
    r["runs"]["original"]["ppl"]["8"] = 90.0  # 9x < 10x, and no unigram perplexity to compare with
    assert claims.claim_a(r, [4, 8])["held"] is False
    r["unigram_ppl"] = 80.0  # 90 is above the unigram model of the same text: a breakdown
    assert claims.claim_a(r, [4, 8])["held"] is True
    r["runs"]["pose-ntk"]["ppl"]["4"] = 9.4  # -6%: outside +-5% (two-sided)
    assert claims.claim_b(r, [4, 8])["held"] is False and "ntk@4: PoSE 9.4 vs Full 10 (-6.0%)" in \
        claims.claim_b(r, [4, 8])["detail"]
    assert claims.claim_d(r, [4, 8])["held"] is None  # chunk ablation missing: not evaluated
    r["runs"].update({k: {"ppl": v, "passkey": {}} for k, v in (
        ("pose-linear-n1", {"4": 10.0, "8": 11.0}), ("randpos-linear", {"4": 10.92, "8": 30.0}),
        ("pose-linear-n3", {"4": 10.5, "8": 10.1}))})
    assert claims.claim_d(r, [4, 8])["held"] is True  # 11 / 10 = 1.10x; 10.92 / 10.4 = 1.05x
    r["runs"]["randpos-linear"]["ppl"]["4"] = 10.9  # 1.048x
    assert claims.claim_d(r, [4, 8])["held"] is False and "N=3: 4: 10.5" in claims.claim_d(r, [4, 8])["detail"]


def test_claim_e_and_c():
    flat = {"seconds_per_step": 1.0, "peak_memory_gb": 1.0}
    cost = {"pose": {"8": flat, "16": {"seconds_per_step": 1.2, "peak_memory_gb": 1.1}},
            "full": {"8": flat, "16": {"seconds_per_step": 1.6, "peak_memory_gb": 2.0}}}
    assert claims.claim_e(_results({}, cost))["held"] is True
    cost["full"]["16"]["seconds_per_step"] = 1.4
    assert claims.claim_e(_results({}, cost))["held"] is False
    passkey = {"pose-yarn": {"4": 1.0, "8": 0.9}, "original": {"4": 0.96, "8": 0.1},
               "pose-linear": {"4": 0.0, "8": 0.0}}
    c = claims.claim_c(_results({}, passkey=passkey), [4, 8])
    assert c["held"] is True  # judged on PoSE + YaRN; PoSE + PI is the ablation, reported beside it
    assert "PoSE + YaRN 4: 1.00, 8: 0.90" in c["detail"] and "PoSE + PI (ablation, not judged) 4: 0.00" in c["detail"]
    passkey["pose-yarn"]["8"] = 0.85
    assert claims.claim_c(_results({}, passkey=passkey), [4, 8])["held"] is False
    passkey["pose-yarn"]["8"] = 0.9
    passkey["original"]["4"] = 0.94  # the base does not retrieve within its own window
    assert claims.claim_c(_results({}, passkey=passkey), [4, 8])["held"] is False
    passkey["original"].update({"4": 1.0, "8": 0.2})
    assert claims.claim_c(_results({}, passkey=passkey), [4, 8])["held"] is False


def test_stages_record_each_stage_once_across_invocations(tmp_path):
    record = tmp_path / "stage_seconds.json"
    first = Stages({"a": 1.0, "b": 1.0}, stream=io.StringIO(), record=record)
    first.run("a", lambda: False, lambda: time.sleep(0.05))
    assert first.recorded()[1] == ["b"]  # b has not run: no time for it
    second = Stages({"a": 1.0, "b": 1.0}, stream=io.StringIO(), record=record)  # a later invocation
    second.run("a", lambda: True, lambda: pytest.fail("a is cached"))
    second.run("b", lambda: False, lambda: time.sleep(0.02))
    total, missing = second.recorded()
    assert missing == [] and second.seconds < total  # this invocation ran b only; the total counts a too
    assert total == pytest.approx(json.loads(record.read_text())["a"] + second.times["b"])
    assert json.loads(record.read_text())["a"] >= 0.05


def test_stages_skip_cached_and_report_eta():
    out = io.StringIO()
    stages = Stages({"a": 1.0, "b": 3.0, "c": 1.0}, stream=out)
    calls = []
    stages.run("a", lambda: True, lambda: calls.append("a"))
    stages.run("b", lambda: False, lambda: calls.append("b"))
    assert calls == ["b"]
    lines = out.getvalue().splitlines()
    assert lines[0] == "[1/3] a: cached" and lines[1] == "[2/3] b: running"
    assert re.fullmatch(r"\[2/3\] b: done in \d+ s; ETA \d+ s", lines[2])
    assert stages.eta() == pytest.approx(stages.seconds / 3.0 * 1.0)


def test_eta_work_estimates_match_the_committed_default_run():
    """The stages' work estimates (`_weights`) against what each kind of stage cost in the committed default run
    (its results.json `stage_seconds`): at that run's overall seconds per unit of work, every kind's total is
    predicted within 1.5x, and the ETA printed after the first stage is within 1.5x of what the rest took."""
    results = json.loads((Path(__file__).parents[1] / "benchmarks/results/sim/results.json").read_text())
    config = parse_config(["--out", results["config"]["out"]])
    # the committed run is the default one (assembled with --reuse-results from the earlier default run)
    assert results["config"] == config.to_dict()
    assert results["argv"] in ("", "--reuse-results benchmarks/results/sim/results.json")
    weights = sim._weights(config, sim.grid_runs(config.factor))
    times = results["stage_seconds"]
    # every stage of the runs it holds timed (the base was copied, not pre-trained)
    # and of none of the grid's runs it does not hold yet (run folders: the adapt-* controls share `adapt`)
    missing = {r.folder for r in sim.grid_runs(config.factor) if not r.cost_only and r.name not in results["runs"]}
    missing |= {r.name for r in sim.grid_runs(config.factor) if not r.cost_only and r.name not in results["runs"]}
    assert set(times) == {n for n in weights if n.split(" ", 1)[-1] not in missing} - {"pretrain"}
    rate = sum(times.values()) / sum(weights[name] for name in times)

    def kind(name: str) -> str:
        words = name.split()
        return ("full-length training" if words[0] == "finetune" and "full" in words[1]
                else " ".join(words[:2]) if words[:2] == ["finetune", "data"] else words[0])

    totals = {}
    for name, seconds in times.items():
        total = totals.setdefault(kind(name), [0.0, 0.0])
        total[0] += seconds
        total[1] += weights[name] * rate
    assert len(totals) == 8
    for name, (measured, predicted) in totals.items():
        assert 1 / 1.5 < predicted / measured < 1.5, (name, measured, predicted)
    order = [name for name in weights if name in times]
    first, rest = order[0], order[1:]
    eta = times[first] / weights[first] * sum(weights[name] for name in rest)
    assert 1 / 1.5 < eta / sum(times[name] for name in rest) < 1.5


def test_the_real_models_methods_in_the_grid(tmp_path):
    """The adapt-* controls: one plain fine-tuning (folder `adapt`, original RoPE while training) with the PoSE
    runs' settings, extended at load; frequencies only: YaRN with attention factor 1."""
    from dataclasses import replace

    from pose_mlx.sim.grid import finetune_settings, grid_runs, load_schedule

    runs = {r.name: r for r in grid_runs(8)}
    common = dict(window=128, factor=8, steps=150, cost_steps=20, full_batch=4, lr=2e-4, seed=0)

    def settings(name):
        run = runs[name]
        return finetune_settings(run, tmp_path / "base", tmp_path / "data", tmp_path / "cache",
                                 tmp_path / "runs" / run.folder, **common).settings

    pose, adapt = settings("pose-yarn"), settings("adapt-yarn")
    assert runs["adapt-yarn"].folder == runs["adapt-dynamic"].folder == "adapt" and settings("adapt-dynamic") == adapt
    # the same run as PoSE + YaRN but for the sampler and the schedule while training
    assert adapt == replace(pose, sampler="plain", schedule="none", output=str(tmp_path / "runs" / "adapt"))
    assert load_schedule(runs["adapt-dynamic"], 8) == ("dynamic", "8x")
    assert load_schedule(runs["pose-yarn"], 8) == load_schedule(runs["only-dynamic"], 8) == (None, None)
    notemp = settings("pose-yarn-notemp")
    assert notemp.schedule_params == {"attention_factor": 1.0}
    assert notemp == replace(pose, schedule_params={"attention_factor": 1.0},
                             output=str(tmp_path / "runs" / "pose-yarn-notemp"))
    assert settings("only-dynamic").schedule == "dynamic"
    assert "params" not in runs["pose-yarn"].spec()  # specs of runs without it read as before it existed
    assert runs["pose-yarn-notemp"].spec()["params"] == "attention_factor=1"
