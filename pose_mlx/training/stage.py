"""The training stage of a fine-tuning run: from an extended model and the run's plan to a trained model.

`fine_tune(model, tokenizer, plan, at_positions)`: the trainable parameters (LoRA adapters or all weights), the data
streams (`training.data`), the loop (`training.loop`) in the run folder that the plan prepared
(`<output>.partial`: run.json, log.jsonl, checkpoint/), and a last check that training did not destroy the model.
`at_positions(model, ids)` says how the model reads a batch's position ids (`pose_mlx.use_positions`). Returns the
summary that the export records (empty for `--sampler none`, which trains nothing).
"""

from __future__ import annotations

import sys
import time

import mlx.nn as nn

from .checkpoint import last_files, trained_steps
from .data import training_data
from .lora import add_lora
from .loop import TrainConfig, check_not_collapsed, loss_scale_for, probe_loss, read_log, train


def fine_tune(model: nn.Module, tokenizer, plan, at_positions) -> dict:
    """Train `model` as `plan` (a `pose_mlx.plan.RunPlan`) says; returns the run's summary (`steps`, `tokens`:
    all the run's, resumed or not; `steps_run`, `tokens_run`, `seconds`: this invocation's)."""
    s, world = plan.settings, plan.world
    if s.sampler == "none":
        return {}
    loss_scale = loss_scale_for(model, s.loss_scale)  # from the base weights' precision, before LoRA is added
    if plan.lora is not None:
        add_lora(model, plan.lora, s.seed)
    else:
        model.unfreeze()
    data = training_data(s, tokenizer, plan.window, plan.target, world,
                         row_multiple=plan.memory_plan.settings.row_multiple)  # padded as the plan predicted
    if world.is_main and data.skipped.unreadable():  # empty files are not worth a warning: nothing is lost
        print(f"warning: --data {s.data}: skipped {data.skipped.unreadable()} unreadable files or lines "
              f"({data.skipped.skipped_binary} binary, {data.skipped.skipped_encoding} not UTF-8)", file=sys.stderr)
    config = TrainConfig(steps=s.steps, lr=s.lr, warmup=s.warmup, max_grad_norm=s.max_grad_norm,
                         grad_accum=s.grad_accum, grad_checkpoint=s.grad_checkpoint, compile=s.compile,
                         kernels=s.kernels,
                         loss_scale=loss_scale, save_every=s.save_every, eval_every=s.eval_every, progress=s.progress,
                         resume_command=plan.resume_command)
    t0, start = time.perf_counter(), trained_steps(plan.partial) if plan.resume else 0
    before = probe_loss(model, data.probe, at_positions, s.kernels)
    last = train(model, data.stream, config, plan.partial, at_positions, data.eval_batches, resume=plan.resume,
                 world=world)
    log = read_log(plan.partial / "log.jsonl") if world.is_main else [last]
    if world.is_main:
        check_not_collapsed(model, data.probe, at_positions, before, step=last["step"], kernels=s.kernels)
    evals = [r["eval_loss"] for r in log if r.get("eval_loss") is not None]
    return {"steps": last["step"], "final_loss": last["loss"], "tokens": int(sum(r["tokens"] for r in log)),
            "steps_run": last["step"] - start, "tokens_run": int(sum(r["tokens"] for r in log if r["step"] > start)),
            "tokens_per_step": last["tokens"], "seconds": time.perf_counter() - t0,
            "peak_memory_gb": max(r["peak_memory_gb"] or 0.0 for r in log), "eval_loss": evals[-1] if evals else None,
            "data_fingerprint": data.fingerprint, "training": "full" if plan.lora is None else "lora",
            "lr": s.lr, "seed": s.seed, "loss_scale": loss_scale,
            # LoRA: the last checkpoint goes with the output (small), so --resume --steps can train it longer
            "checkpoint_files": [] if plan.lora is None else [str(p) for p in last_files(plan.partial / "checkpoint")]}


__all__ = ["fine_tune"]
