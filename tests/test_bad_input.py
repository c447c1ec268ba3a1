"""A sweep of bad inputs across every command, as a new user would make them: each ends with exactly one line on
stderr (`<command>: error: ...` naming what is wrong), exit code 2, no traceback, and nothing written."""

import errno
import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from _finetune_helpers import text_dir, tiny_model  # noqa: F401
from pose_mlx import convert, demo, finetune, generate, launch, plan
from pose_mlx.eval import passkey, perplexity, ruler
from pose_mlx.sim import __main__ as sim
from pose_mlx.sim import map as sim_map


def _coverage_tool():
    spec = importlib.util.spec_from_file_location("coverage_tool", Path(__file__).parents[1] / "tools" / "coverage.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


coverage_tool = _coverage_tool()

DEFAULT = ["--window", "16", "--steps", "3", "--no-progress"]


@pytest.fixture(scope="module")
def place(tiny_model, text_dir, tmp_path_factory):
    """Broken things to point the commands at, built once."""
    root = tmp_path_factory.mktemp("broken")
    bad_json = shutil.copytree(tiny_model, root / "bad-json")
    (bad_json / "config.json").write_text("{not json")
    no_type = shutil.copytree(tiny_model, root / "no-type")
    config = json.loads((no_type / "config.json").read_text())
    del config["model_type"]
    (no_type / "config.json").write_text(json.dumps(config))
    torn = shutil.copytree(tiny_model, root / "torn-weights")
    weights = torn / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: 200])
    no_tok = shutil.copytree(tiny_model, root / "no-tokenizer")
    for f in no_tok.glob("tokenizer*"):
        f.unlink()
    (root / "empty").mkdir()
    (root / "file.bin").write_bytes(b"\x00\x01")
    unreadable = root / "unreadable"
    unreadable.mkdir()
    (unreadable / "a.txt").write_bytes(b"")
    (unreadable / "b.txt").write_bytes(bytes(range(256)))
    jsonl = root / "bad.jsonl"
    jsonl.write_text('{"text": "fine"}\n{"text": \n')
    wrong_field = root / "wrong.jsonl"
    wrong_field.write_text('{"body": "no text field"}\n')
    yaml = {name: root / f"{name}.yaml" for name in ("unknown", "bool", "number", "list", "binary", "lora")}
    yaml["unknown"].write_text(f"model: {tiny_model}\ntarget: 4x\nstepz: 3\n")
    yaml["bool"].write_text(f"model: {tiny_model}\ntarget: 4x\ngrad_checkpoint: 'yes'\n")
    yaml["number"].write_text(f"model: {tiny_model}\ntarget: 4x\nlr: fast\n")
    yaml["list"].write_text("- model\n- target\n")
    yaml["binary"].write_bytes(b"\xff\xfe\x00bad")
    yaml["lora"].write_text(f"model: {tiny_model}\ntarget: 4x\nlora_parameters: {{rank: 8, dropout: 0.1}}\n")
    short = root / "short.txt"
    short.write_text("The sky is blue.")
    run = root / "damaged-run"
    (run.parent / "damaged-run.partial").mkdir()
    (run.parent / "damaged-run.partial" / "run.json").write_text("{torn")
    gpt2 = root / "gpt2"
    from pose_mlx import toy
    from pose_mlx.model.source import build_model

    cfg = {"model_type": "gpt2", "n_embd": 16, "n_head": 2, "n_layer": 1, "n_positions": 64, "n_ctx": 64,
           "vocab_size": 512, "layer_norm_epsilon": 1e-5}
    toy.save_model_folder(build_model(cfg, seed=0), cfg, toy.copy_tokenizer(tiny_model, root / "tok"), gpt2)
    configs = {}
    for name, (key, value) in BAD_CONFIGS.items():  # config.json of the wrong JSON type
        folder = configs[f"cfg-{name}"] = shutil.copytree(tiny_model, root / f"cfg-{name}")
        good = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps([good] if key is None else {**good, key: value}))
    return {**configs,"model": tiny_model, "data": text_dir, "root": root, "bad-json": bad_json, "no-type": no_type,
            "torn": torn, "no-tok": no_tok, "empty": root / "empty", "bin": root / "file.bin",
            "unreadable": unreadable, "jsonl": jsonl, "wrong": wrong_field, "short": short, "run": run,
            "gpt2": gpt2, **{f"yaml-{k}": v for k, v in yaml.items()}}


#: config.json changes: (key, value), or (None, None) for a list where the object belongs.
BAD_CONFIGS = {"list": (None, None), "hidden-word": ("hidden_size", "big"), "theta-null": ("rope_theta", None),
               "heads-text": ("num_attention_heads", "4"), "layers-fraction": ("num_hidden_layers", 2.5),
               "theta-zero": ("rope_theta", 0), "scaling-list": ("rope_scaling", [1, 2])}
#: what the line names for each
BAD_CONFIG_NAMES = {"list": "JSON list, not an object", "hidden-word": "hidden_size", "theta-null": "rope_theta",
                    "heads-text": "num_attention_heads", "layers-fraction": "num_hidden_layers",
                    "theta-zero": "rope_theta", "scaling-list": "rope_scaling"}
NOT_UTF8 = "\udcff"  # the byte 0xff in a command line, as Python decodes it (surrogateescape)


def _ft(*args):
    return finetune.main, ["--output", "{out}/o", "--cache-dir", "{out}/cache", *args]


def _ev(module, *args):
    return module.main, [*args]


# (id, command, argv with {name} placeholders, what the line must name)
CASES = [
    ("ft-nothing", *_ft(), "--model is required"),
    ("ft-no-target", *_ft("--model", "{model}"), "--target is required"),
    ("ft-missing-model", *_ft("--model", "{root}/nowhere", "--target", "4x"), "no such folder or file"),
    ("ft-unknown-alias", *_ft("--model", "llama-99b", "--target", "4x"), "not a known alias"),
    ("ft-model-is-a-file", *_ft("--model", "{bin}", "--target", "4x"), "not a .gguf model"),
    ("ft-no-config", *_ft("--model", "{empty}", "--target", "4x"), "no config.json"),
    ("ft-bad-config-json", *_ft("--model", "{bad-json}", "--target", "4x", "--sampler", "none"), "not valid JSON"),
    ("ft-config-no-type", *_ft("--model", "{no-type}", "--target", "4x", "--sampler", "none"), "model_type"),
    ("ft-torn-weights", *_ft("--model", "{torn}", "--target", "4x", "--sampler", "none"), "cannot load it"),
    ("ft-no-tokenizer", *_ft("--model", "{no-tok}", "--target", "4x", "--sampler", "none"), "no tokenizer files"),
    ("ft-no-rope", *_ft("--model", "{gpt2}", "--target", "256", "--original", "64", "--sampler", "none"), "no RoPE"),
    ("ft-absurd-target", *_ft("--model", "{model}", "--target", "1000000000000", "--sampler", "none"), "outside"),
    ("ft-target-word", *_ft("--model", "{model}", "--target", "long", "--sampler", "none"), "not a length"),
    ("ft-target-fraction", *_ft("--model", "{model}", "--target", "8.5", "--sampler", "none"), "whole number"),
    ("ft-target-not-larger", *_ft("--model", "{model}", "--target", "1x", "--sampler", "none"), "must be larger"),
    ("ft-seed-negative", *_ft("--model", "{model}", "--target", "4x", "--data", "{data}", "--seed", "-1"), "--seed"),
    ("ft-lora-rank-float", *_ft("--model", "{model}", "--target", "4x", "--data", "{data}", "--lora-rank", "1e8"),
     "--lora-rank"),
    ("ft-lora-rank-huge", *_ft("--model", "{model}", "--target", "4x", "--data", "{data}", "--lora-rank",
                               "100000000"), "--lora-rank"),
    ("ft-lora-rank-over-hidden", *_ft("--model", "{model}", "--target", "4x", "--data", "{data}", "--lora-rank",
                                      "64"), "hidden size"),
    ("ft-lora-layers-negative", *_ft("--model", "{model}", "--target", "4x", "--data", "{data}", "--lora-layers",
                                     "-5"), "--lora-layers"),
    ("ft-min-length-negative", *_ft("--model", "{model}", "--target", "4x", "--data", "{data}", "--min-length",
                                    "-5"), "--min-length"),
    ("ft-lr-inf", *_ft("--model", "{model}", "--target", "4x", "--data", "{data}", "--lr", "inf"), "--lr"),
    ("ft-lr-nan", *_ft("--model", "{model}", "--target", "4x", "--data", "{data}", "--lr", "nan"), "--lr"),
    ("ft-lr-negative", *_ft("--model", "{model}", "--target", "4x", "--data", "{data}", "--lr", "-1"), "--lr"),
    ("ft-steps-zero", *_ft("--model", "{model}", "--target", "4x", "--data", "{data}", "--steps", "0"), "--steps"),
    ("ft-batch-zero", *_ft("--model", "{model}", "--target", "4x", "--data", "{data}", "--batch-size", "0"),
     "--batch-size"),
    ("ft-chunks-zero", *_ft("--model", "{model}", "--target", "4x", "--data", "{data}", "--chunks", "0"),
     "--chunks"),
    ("ft-chunks-over-window", *_ft("--model", "{model}", "--target", "4x", "--data", "{data}", "--window", "4",
                                   "--chunks", "5"), "--chunks"),
    ("ft-window-one", *_ft("--model", "{model}", "--target", "4x", "--data", "{data}", "--window", "1"),
     "--window"),
    ("ft-window-over-target", *_ft("--model", "{model}", "--target", "4x", "--data", "{data}", "--window", "999"),
     "--window"),
    ("ft-schedule-unknown", *_ft("--model", "{model}", "--target", "4x", "--sampler", "none", "--schedule",
                                 "yarm"), "did you mean 'yarn'"),
    ("ft-schedule-param-form", *_ft("--model", "{model}", "--target", "4x", "--sampler", "none",
                                    "--schedule-param", "beta"), "key=value"),
    ("ft-schedule-param-value", *_ft("--model", "{model}", "--target", "4x", "--sampler", "none", "--schedule",
                                     "yarn", "--schedule-param", "beta_fast=0.5"), "beta_fast"),
    ("ft-schedule-param-name", *_ft("--model", "{model}", "--target", "4x", "--sampler", "none",
                                    "--schedule-param", "beta=2"), "unknown parameter 'beta'"),
    ("ft-sampler-unknown", *_ft("--model", "{model}", "--target", "4x", "--sampler", "posse"), "--sampler"),
    ("ft-content-unknown", *_ft("--model", "{model}", "--target", "4x", "--data", "{data}", "--content", "all"),
     "--content"),
    ("ft-unknown-flag", *_ft("--model", "{model}", "--target", "4x", "--stepz", "3"), "unrecognized arguments"),
    ("ft-yaml-unknown-key", *_ft("--config", "{yaml-unknown}"), "did you mean 'steps'"),
    ("ft-yaml-quoted-bool", *_ft("--config", "{yaml-bool}"), "grad_checkpoint must be true or false"),
    ("ft-yaml-word-number", *_ft("--config", "{yaml-number}"), "lr must be a number"),
    ("ft-yaml-not-mapping", *_ft("--config", "{yaml-list}"), "must hold a mapping"),
    ("ft-yaml-binary", *_ft("--config", "{yaml-binary}"), "cannot read it"),
    ("ft-yaml-missing", *_ft("--config", "{root}/none.yaml"), "no such file"),
    ("ft-yaml-lora-dropout", *_ft("--config", "{yaml-lora}"), "dropout must be 0"),
    ("ft-no-data", *_ft("--model", "{model}", "--target", "4x"), "--data is required"),
    ("ft-data-missing", *_ft("--model", "{model}", "--target", "4x", "--data", "{root}/nowhere", *DEFAULT),
     "no such file or folder"),
    ("ft-data-unreadable", *_ft("--model", "{model}", "--target", "4x", "--data", "{unreadable}", *DEFAULT),
     "no readable document"),
    ("ft-data-bad-jsonl", *_ft("--model", "{model}", "--target", "4x", "--data", "{jsonl}", *DEFAULT),
     "bad.jsonl:2: not valid JSON"),
    ("ft-data-wrong-field", *_ft("--model", "{model}", "--target", "4x", "--data", "{wrong}", *DEFAULT),
     "wrong.jsonl:1: expected a JSON object"),
    ("ft-data-too-short", *_ft("--model", "{model}", "--target", "4x", "--data", "{short}", *DEFAULT),
     "no document has"),
    ("ft-heldout", *_ft("--model", "{model}", "--target", "4x", "--data", "{data}", "--heldout", "1.5"),
     "--heldout"),
    ("ft-max-memory", *_ft("--model", "{model}", "--target", "4x", "--data", "{data}", "--max-memory", "64KB"),
     "more than 64 KiB"),
    ("ft-max-memory-word", *_ft("--model", "{model}", "--target", "4x", "--data", "{data}", "--max-memory", "lots"),
     "is not a size"),
    ("ft-resume-nothing", *_ft("--model", "{model}", "--target", "4x", "--data", "{data}", "--resume"),
     "no unfinished run"),
    ("ft-resume-damaged-run-json", finetune.main, ["--resume", "--output", "{run}"], "damaged"),
    ("ft-resume-and-overwrite", *_ft("--model", "{model}", "--target", "4x", "--resume", "--overwrite"),
     "exclude each other"),
    ("ft-output-is-a-file", finetune.main, ["--model", "{model}", "--target", "4x", "--sampler", "none",
                                            "--output", "{bin}"], "is a file"),
    ("pk-missing-model", *_ev(passkey, "--model", "{root}/nowhere"), "no such folder or file"),
    ("pk-bad-lengths", *_ev(passkey, "--model", "{model}", "--lengths", "2k,x"), "not a length"),
    ("pk-too-short", *_ev(passkey, "--model", "{model}", "--lengths", "16"), "template"),
    ("pk-trials-zero", *_ev(passkey, "--model", "{model}", "--trials", "0"), "--trials"),
    ("pk-depths-zero", *_ev(passkey, "--model", "{model}", "--depths", "0"), "--depths"),
    ("pk-chunk-zero", *_ev(passkey, "--model", "{model}", "--chunk", "0"), "--chunk"),
    ("pk-seed-negative", *_ev(passkey, "--model", "{model}", "--seed", "-1"), "--seed"),
    ("pk-schedule-without-target", *_ev(passkey, "--model", "{model}", "--schedule", "linear"), "--target"),
    ("pk-target-shorter", *_ev(passkey, "--model", "{model}", "--schedule", "linear", "--target", "8"),
     "shorter than the original window"),
    ("pk-memory", *_ev(passkey, "--model", "{model}", "--lengths", "4096k", "--allow-beyond-window"),
     "than the 1 GiB this machine offers"),
    ("pk-beyond-window", *_ev(passkey, "--model", "{model}", "--lengths", "4x"), "or pass --allow-beyond-window"),
    ("pk-no-tokenizer", *_ev(passkey, "--model", "{no-tok}"), "no tokenizer files"),
    ("ppl-missing-data", *_ev(perplexity, "--model", "{model}", "--data", "{root}/nowhere", "--lengths", "64",
                              "--allow-beyond-window"),
     "no such file or folder"),
    ("ppl-stride-zero", *_ev(perplexity, "--model", "{model}", "--data", "{data}", "--stride", "0"), "--stride"),
    ("ppl-docs-zero", *_ev(perplexity, "--model", "{model}", "--data", "{data}", "--docs", "0"), "--docs"),
    ("ppl-too-short", *_ev(perplexity, "--model", "{model}", "--data", "{short}", "--lengths", "64",
                           "--allow-beyond-window"),
     "no document has"),
    ("ppl-bad-jsonl", *_ev(perplexity, "--model", "{model}", "--data", "{jsonl}", "--lengths", "64",
                           "--allow-beyond-window"),
     "not valid JSON"),
    ("gen-missing-model", *_ev(generate, "--model", "{root}/nowhere", "--prompt", "hi"), "no such folder or file"),
    ("gen-torn-weights", *_ev(generate, "--model", "{torn}", "--prompt", "hi"), "cannot load it"),
    ("gen-no-tokenizer", *_ev(generate, "--model", "{no-tok}", "--prompt", "hi"), "no tokenizer files"),
    ("gen-schedule-without-target", *_ev(generate, "--model", "{model}", "--prompt", "hi", "--schedule", "linear"),
     "--target"),
    ("gen-prompt-file-missing", *_ev(generate, "--model", "{model}", "--prompt-file", "{root}/nowhere.txt"),
     "--prompt-file {root}/nowhere.txt: cannot read it"),
    ("gen-prompt-file-binary", *_ev(generate, "--model", "{model}", "--prompt-file", "{unreadable}/b.txt"),
     "not UTF-8 text"),
    ("gen-no-prompt", *_ev(generate, "--model", "{model}"), "no prompt"),
    ("demo-factor", *_ev(demo, "--out", "{out}/demo", "--factor", "1"), "--factor"),
    ("demo-model", *_ev(demo, "--out", "{out}/demo", "--model", "{root}/nowhere"), "no config.json"),
    ("demo-lr", *_ev(demo, "--out", "{out}/demo", "--lr", "0"), "--lr"),
    ("launch-zero-ranks", launch.main, ["-n", "0", "--", "true"], "at least 1"),
    ("launch-ranks-word", launch.main, ["-n", "two", "--", "true"], "invalid int value"),
    ("launch-no-command", launch.main, ["-n", "2"], "command"),
    ("launch-missing-program", launch.main, ["-n", "2", "--", "{root}/nowhere/python"], "cannot start"),
    ("launch-grace-negative", launch.main, ["-n", "2", "--grace", "-1", "--", "true"], "--grace"),
    ("launch-grace-inf", launch.main, ["-n", "2", "--grace", "inf", "--", "true"], "--grace"),
    ("launch-ranks-huge", launch.main, ["-n", "100000000", "--", "true"], "at most"),
]

# An output, cache or run folder whose parent is a file: refused before anything is loaded or written.
CASES += [
    ("parent-file-ft-output", finetune.main, ["--model", "{model}", "--target", "4x", "--sampler", "none", "--output",
                                              "{bin}/o"], "{bin} is a file, not a folder"),
    ("parent-file-ft-output-deep", finetune.main, ["--model", "{model}", "--target", "4x", "--sampler", "none",
                                                   "--output", "{bin}/a/b/o"], "{bin} is a file, not a folder"),
    ("parent-file-ft-cache", *_ft("--model", "{model}", "--target", "4x", "--data", "{data}", "--cache-dir",
                                  "{bin}/c", *DEFAULT), "--cache-dir"),
    ("parent-file-ft-cache-is-file", *_ft("--model", "{model}", "--target", "4x", "--data", "{data}", "--cache-dir",
                                          "{bin}", *DEFAULT), "is a file"),
    ("parent-file-ft-resume", finetune.main, ["--resume", "--output", "{bin}/o"], "{bin} is a file, not a folder"),
    ("parent-file-pk-output", passkey.main, ["--model", "{model}", "--output", "{bin}/p.json"], "--output"),
    ("parent-file-ppl-output", perplexity.main, ["--model", "{model}", "--data", "{data}", "--output", "{bin}/p.json"],
     "--output"),
    ("parent-file-ruler-output", ruler.main, ["--model", "{model}", "--output", "{bin}/r.json"], "--output"),
    ("parent-file-convert-out", convert.main, ["{bin}", "{bin}/converted"], "{bin} is a file, not a folder"),
    ("parent-file-sim-out", sim.main, ["--quick", "--out", "{bin}/sim"], "--out"),
    ("parent-file-sim-map-out", sim_map.main, ["--quick", "--out", "{bin}/map"], "--out"),
    ("sim-map-out-is-file", sim_map.main, ["--quick", "--out", "{bin}"], "is a file; choose a folder name"),
    ("parent-file-sim-map-report", sim_map.main, ["--quick", "--out", "{out}/map", "--report", "{bin}/r"],
     "--report"),
    ("parent-file-demo-out", demo.main, ["--out", "{bin}/demo"], "--out"),
    ("parent-file-coverage-out", coverage_tool.main, ["--out", "{bin}/cov"], "--out"),
]
# Bytes that are not UTF-8 in a path: refused by every command's parser, the flag named.
CASES += [
    (f"not-utf8-{name}", main, [a.replace("@", NOT_UTF8) for a in argv], fragment)
    for name, main, argv, fragment in [
        ("ft-output", finetune.main, ["--model", "{model}", "--target", "4x", "--sampler", "none", "--output",
                                      "{out}/@dir"], "--output '{out}/\\xffdir' is not valid UTF-8"),
        ("ft-output-equals", finetune.main, ["--model", "{model}", "--target", "4x", "--sampler", "none",
                                             "--output={out}/@dir"], "--output"),
        ("ft-data", finetune.main, ["--model", "{model}", "--target", "4x", "--data", "@", "--output", "{out}/o"],
         "--data '\\xff' is not valid UTF-8"),
        ("ft-cache", finetune.main, ["--model", "{model}", "--target", "4x", "--data", "{data}", "--output", "{out}/o",
                                     "--cache-dir", "{out}/@c", *DEFAULT], "--cache-dir"),
        ("ft-model", finetune.main, ["--model", "@", "--target", "4x"], "--model"),
        ("plan-model", plan.main, ["--model", "@", "--target", "4x"], "--model"),
        ("pk-output", passkey.main, ["--model", "{model}", "--output", "{out}/@.json"], "--output"),
        ("ppl-data", perplexity.main, ["--model", "{model}", "--data", "{root}/@"], "--data"),
        ("ppl-output", perplexity.main, ["--model", "{model}", "--data", "{data}", "--output", "{out}/@.json"],
         "--output"),
        ("ruler-output", ruler.main, ["--model", "{model}", "--output", "{out}/@.json"], "--output"),
        ("ruler-haystack", ruler.main, ["--model", "{model}", "--haystack", "{root}/@"], "--haystack"),
        ("convert-out", convert.main, ["{bin}", "{out}/@"], "argument '{out}/\\xff' is not valid UTF-8"),
        ("convert-gguf", convert.main, ["{root}/@.gguf", "{out}/c"], "is not valid UTF-8"),
        ("sim-out", sim.main, ["--quick", "--out", "{out}/@sim"], "--out"),
        ("sim-corpus", sim.main, ["--quick", "--out", "{out}/sim", "--corpus", "{root}/@"], "--corpus"),
        ("sim-map-out", sim_map.main, ["--quick", "--out", "{out}/@map"], "--out"),
        ("demo-out", demo.main, ["--out", "{out}/@demo"], "--out"),
        ("demo-model", demo.main, ["--out", "{out}/demo", "--model", "{root}/@"], "--model"),
        ("coverage-out", coverage_tool.main, ["--out", "{out}/@cov"], "--out"),
        ("gen-prompt-file", generate.main, ["--model", "{model}", "--prompt-file", "{root}/@.txt"], "--prompt-file"),
    ]
]
# A model config of the wrong JSON type, for every command that reads a model (before any weight is read).
CASES += [
    (f"config-{kind}-{name}", main, [a.replace("@", f"{{cfg-{kind}}}") for a in argv], BAD_CONFIG_NAMES[kind])
    for kind in BAD_CONFIGS
    for name, main, argv in [
        ("ft-none", finetune.main, ["--model", "@", "--target", "128", "--original", "32", "--sampler", "none",
                                    "--output", "{out}/o"]),
        ("ft-pose", finetune.main, ["--model", "@", "--target", "128", "--original", "32", "--data", "{data}",
                                    "--output", "{out}/o", "--cache-dir", "{out}/cache", *DEFAULT]),
        ("plan", plan.main, ["--model", "@", "--target", "128", "--original", "32"]),
        ("pk", passkey.main, ["--model", "@", "--output", "{out}/p.json"]),
        ("ppl", perplexity.main, ["--model", "@", "--data", "{data}", "--output", "{out}/p.json"]),
        ("ruler", ruler.main, ["--model", "@", "--output", "{out}/r.json"]),
        ("demo", demo.main, ["--out", "{out}/demo", "--model", "@"]),
        ("gen", generate.main, ["--model", "@", "--prompt", "hi"]),
    ]
]
# Simulator and demo settings out of range: validated once, before --out is created.
CASES += [
    (f"sim-{name}", sim.main, ["--quick", "--out", "{out}/sim", flag, value], fragment)
    for name, flag, value, fragment in [
        ("rope-base-zero", "--rope-base", "0", "--rope-base"), ("rope-base-negative", "--rope-base", "-5", "--rope-base"),
        ("rope-base-nan", "--rope-base", "nan", "--rope-base"), ("rope-base-inf", "--rope-base", "inf", "--rope-base"),
        ("heads-not-dividing", "--heads", "3", "--heads 3 must divide --hidden 32"),
        ("lr-nan", "--lr", "nan", "--lr"), ("lr-inf", "--lr", "inf", "--lr"), ("lr-zero", "--lr", "0", "--lr"),
        ("pretrain-lr-nan", "--pretrain-lr", "nan", "--pretrain-lr"),
        ("pretrain-lr-negative", "--pretrain-lr=-1e-3", None, "--pretrain-lr"),
        ("val-fraction-above", "--val-fraction", "1.5", "--val-fraction"),
        ("val-fraction-negative", "--val-fraction=-0.1", None, "--val-fraction"),
        ("val-fraction-nan", "--val-fraction", "nan", "--val-fraction"),
        ("retrieval-fraction-above", "--retrieval-fraction", "2", "--retrieval-fraction"),
        ("finetune-retrieval-negative", "--finetune-retrieval=-0.5", None, "--finetune-retrieval"),
        ("seed-negative", "--seed=-1", None, "--seed"), ("seed-huge", "--seed", str(2**40), "--seed"),
        ("window-zero", "--window", "0", "--window"), ("window-one", "--window", "1", "--window"),
        ("hidden-negative", "--hidden=-4", None, "--hidden"), ("vocab-small", "--vocab", "100", "--vocab"),
        ("corpus-chars-zero", "--corpus-chars", "0", "--corpus-chars"),
        ("factor-one", "--factor", "1", "--factor"), ("steps-zero", "--steps", "0", "--steps"),
        ("corpus-missing", "--corpus", "{root}/nowhere", "--corpus"),
        ("pretrained-missing", "--pretrained", "{root}/nowhere", "--pretrained"),
        ("out-is-a-file", "--out", "{bin}", "is a file"),
        # validated, but the corpus is refused while it is read: the --out this run made is removed again
        ("corpus-too-small", "--corpus", "{short}", "documents"),
    ]
]
CASES += [
    (f"demo-{name}", demo.main, ["--out", "{out}/demo", flag, value], fragment)
    for name, flag, value, fragment in [
        ("lr-nan", "--lr", "nan", "--lr"), ("lr-inf", "--lr", "inf", "--lr"),
        ("retrieval-above", "--retrieval", "1.5", "--retrieval"), ("retrieval-nan", "--retrieval", "nan", "--retrieval"),
        ("factor-zero", "--factor", "0", "--factor"), ("factor-huge", "--factor", "100000000", "--factor"),
        ("steps-huge", "--steps", str(10**10), "--steps"), ("batch-negative", "--batch-size=-1", None, "--batch-size"),
        ("schedule-unknown", "--schedule", "bogus", "--schedule"), ("out-is-a-file", "--out", "{bin}", "is a file"),
    ]
]
CASES = [(name, main, [a for a in argv if a is not None], fragment) for name, main, argv, fragment in CASES]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(place, tmp_path, capsys, monkeypatch, case):
    name, main, argv, fragment = case
    out = tmp_path / "work"
    out.mkdir()
    monkeypatch.chdir(out)  # a command that wrongly writes to the current folder is caught too
    # The same machine for every case, whatever runs the suite (a 4M-token evaluation fits a large one):
    monkeypatch.setattr("pose_mlx.memory.device.available_memory", lambda: (2**30, "a 1 GiB test machine"))
    values = {k: str(v) for k, v in place.items()} | {"out": str(out)}
    before = {p for p in place["root"].rglob("*")}
    code = main([a.format(**values) for a in argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("warning:")]
    assert code == 2, err
    assert len(lines) == 1 and "Traceback" not in err and ": error: " in lines[0], err
    assert fragment.format(**values) in lines[0], lines[0]
    assert [p.name for p in out.iterdir()] == [], "something was written"
    assert {p for p in place["root"].rglob("*")} == before


def test_a_read_only_or_full_disk_is_one_line(tiny_model, tmp_path, capsys, monkeypatch):
    """OSError for a full or read-only disk (or permission denied) is the user's environment: one line, exit 2."""
    import pose_mlx.model.export as export

    def full(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "o"))

    monkeypatch.setattr(export, "save_config", full, raising=False)
    monkeypatch.setattr("mlx_lm.utils.save_config", full)
    code = finetune.main(["--model", str(tiny_model), "--target", "4x", "--sampler", "none", "--output",
                          str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("pose_mlx.finetune: error: No space left"), err
    assert not (tmp_path / "o").exists()


def test_other_exceptions_keep_their_traceback(tiny_model, tmp_path, monkeypatch):
    """A bug is not a user error: it is not turned into one line."""
    import pose_mlx.model.export as export

    def bug(*_args, **_kwargs):
        raise ValueError("a bug")

    monkeypatch.setattr(export, "export_config", bug)
    with pytest.raises(ValueError, match="a bug"):
        finetune.main(["--model", str(tiny_model), "--target", "4x", "--sampler", "none", "--output",
                       str(tmp_path / "o")])


@pytest.mark.parametrize("module", ["convert", "demo", "finetune", "launch", "passkey", "perplexity", "plan", "ruler",
                                    "sim.__main__", "sim.map"])
def test_every_command_prints_its_help(module, capsys):
    """`--help` of every command exits 0 and lists flags (argparse expands "%" in help strings: a stray one
    crashes --help, as "95% interval" once did in the simulator's)."""
    import importlib

    main = importlib.import_module(f"pose_mlx.{module}").main
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code in (0, None)
    text = capsys.readouterr().out
    assert text.startswith("usage:") and text.count("\n  -") >= 2
