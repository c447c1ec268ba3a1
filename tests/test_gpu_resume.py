"""A fine-tuning cut by a GPU session's budget goes on in the next session from what came back: a tiny LoRA run
stopped as the budget stops it (SIGTERM, after step 4 of 8), packed by the GPU runner's own rules
(`gpu_jobs.groups`, `gpu_pack.pack`: its run.json, log and last checkpoint only), unpacked into another checkout,
resumed there with `pose_mlx.finetune --resume`, gives the per-step losses of an uninterrupted run."""

import json
import os
import signal

import mlx.core as mx
import numpy as np
from _finetune_helpers import read_log, text_dir, tiny_model  # noqa: F401

from experiments import gpu_jobs, gpu_pack

STEPS, CUT = 8, 4


def argv(model, data, out, cache):
    return ["--model", str(model), "--target", "4x", "--data", str(data), "--output", str(out), "--cache-dir",
            str(cache), "--window", "16", "--steps", str(STEPS), "--lr", "3e-3", "--warmup", "2", "--save-every", "3",
            "--batch-size", "2", "--lora-layers", "1", "--no-progress"]


def test_a_run_cut_by_the_budget_resumes_elsewhere_from_what_came_back(tiny_model, text_dir, tmp_path, monkeypatch,
                                                                      capsys):
    import pose_mlx.training.loop as loop
    from pose_mlx import finetune

    cache = tmp_path / "cache"
    assert finetune.main(argv(tiny_model, text_dir, tmp_path / "reference", cache)) == 0
    reference = [r["loss"] for r in read_log(tmp_path / "reference" / "train_log.jsonl")]

    checkout = tmp_path / "gpu-checkout"  # the GPU machine's copy of the checkout
    results, out = checkout / "benchmarks" / "results", checkout / "out" / "real_model" / "trained" / "run"
    results.mkdir(parents=True)
    before = gpu_pack.snapshot([results, out.parent])
    append = loop.append_log

    def budget_ends_at_step(log, record):  # what run_logged does when the budget runs out: SIGTERM
        append(log, record)
        if record["step"] == CUT:
            os.kill(os.getpid(), signal.SIGTERM)

    with monkeypatch.context() as patch:
        patch.setattr(loop, "append_log", budget_ends_at_step)
        assert finetune.main(argv(tiny_model, text_dir, out, cache)) == 128 + signal.SIGTERM
    capsys.readouterr()
    partial = out.with_name("run.partial")
    state = json.loads((partial / "checkpoint" / "state.json").read_text())
    assert state["step"] == CUT and (partial / "checkpoint" / "previous.json").is_file()  # two generations kept

    changed, removed = gpu_pack.changes(before, gpu_pack.snapshot([results, out.parent]))
    packed = gpu_pack.pack(gpu_jobs.groups(changed, [results]), removed, tmp_path / "OUT", checkout, 60 * 2**20)
    names = sorted(packed["manifest"])
    prefix = "out/real_model/trained/run.partial/"
    assert names == sorted(prefix + n for n in ("run.json", "log.jsonl", "checkpoint/state.json",
                                                f"checkpoint/weights-{CUT}.safetensors",
                                                f"checkpoint/optimizer-{CUT}.safetensors"))  # not step 3's
    assert packed["left_behind"] == []
    weights = mx.load(str(partial / "checkpoint" / f"weights-{CUT}.safetensors"))
    assert {v.dtype for v in weights.values()} == {mx.float32}  # exact: the resumed run continues bit for bit

    elsewhere = tmp_path / "next-session"
    (tmp_path / "OUT" / "gpu_jobs.json").write_text(json.dumps({"sha256": packed["sha256"],
                                                                "manifest": packed["manifest"]}))
    gpu_pack.unpack([tmp_path / "OUT" / n for n in packed["packed"]], elsewhere)
    resumed = elsewhere / "out" / "real_model" / "trained" / "run"
    assert finetune.main(["--resume", "--output", str(resumed)]) == 0, capsys.readouterr().err
    log = read_log(resumed / "train_log.jsonl")
    assert [r["step"] for r in log] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([r["loss"] for r in log], reference, atol=1e-5, rtol=0)
