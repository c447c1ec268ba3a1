"""Cost of `pose_mlx.ruler`: building prompts to a token budget, and what KV-cache prefix reuse saves.

1. Prompt building: every task at each of `--lengths`, `--samples` prompts each, with a sentencepiece tokenizer
   trained here on the language reference (`pose_mlx.toy.train_tokenizer`); seconds per prompt and full
   tokenizations per prompt (the sizing search's count, `PromptFormat.encode` calls), and the prompt lengths
   as a fraction of the budget (min, max).
2. Prefix reuse: `run_ruler` on the needle tasks that share a haystack (noise, essay) with a random llama, the
   KV cache of the shared prefix kept (`reuse=True`) vs recomputed, side by side in one process, repeated
   `--repeats` times alternating; prompt tokens fed through the model and the best wall time of each. The
   greedy answers of both must match, else nothing is written.

Writes benchmarks/results/ruler.json.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import pose_mlx  # noqa: F401

from benchmarks.common import write_results
from pose_mlx import toy
from pose_mlx.eval import haystack, longctx, ruler, ruler_tasks


def prompt_building(tokenizer, lengths: list[int], samples: int) -> list[dict]:
    builder = ruler_tasks.PromptBuilder(tokenizer, samples, seed=0)
    calls = {"n": 0}
    encode = builder.fmt.encode

    def counted(text):
        calls["n"] += 1
        return encode(text)

    builder.fmt.encode = counted
    rows = []
    for length in lengths:
        for task in ruler_tasks.TASKS:
            calls["n"], start = 0, time.perf_counter()
            fill = [len(builder.sample(task, length, i).tokens) / length for i in range(samples)]
            rows.append({"task": task, "length": length, "seconds_per_prompt": (time.perf_counter() - start) / samples,
                         "encodes_per_prompt": calls["n"] / samples, "fill_min": min(fill), "fill_max": max(fill)})
            print(f"{task:>16} @ {length:>6}: {rows[-1]['seconds_per_prompt']:.3f} s/prompt, "
                  f"{rows[-1]['encodes_per_prompt']:.1f} encodes, fill {min(fill):.4f}-{max(fill):.4f}", flush=True)
    return rows


def prefix_reuse(model, tokenizer, length: int, samples: int, repeats: int, chunk: int) -> dict:
    tasks = [t for t, spec in ruler_tasks.TASKS.items() if spec.kind == "niah" and spec.haystack != "needles"]
    best = {True: float("inf"), False: float("inf")}
    runs = {}
    for _ in range(repeats):
        for reuse in (True, False):
            start = time.perf_counter()
            runs[reuse] = ruler.run_ruler(model, tokenizer, [length], tasks, samples, seed=0, chunk=chunk,
                                          max_new_tokens=8, show_progress=False, reuse=reuse)
            best[reuse] = min(best[reuse], time.perf_counter() - start)
    answers = {reuse: [(r.task, r.index, r.output) for r in run.records] for reuse, run in runs.items()}
    if answers[True] != answers[False]:
        raise SystemExit("reused and recomputed prefixes gave different answers; nothing written")
    return {"tasks": tasks, "length": length, "samples": samples, "prompt_tokens": runs[True].prompt_tokens,
            "computed_tokens_reuse": runs[True].computed_tokens, "computed_tokens_fresh": runs[False].computed_tokens,
            "seconds_reuse": best[True], "seconds_fresh": best[False], "speedup": best[False] / best[True]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="4k,16k,64k", help="prompt-building lengths")
    parser.add_argument("--samples", type=int, default=3, help="prompts per task and length when building")
    parser.add_argument("--vocab", type=int, default=4000, help="sentencepiece pieces")
    parser.add_argument("--reuse-length", type=int, default=4096, help="prompt length of the reuse comparison")
    parser.add_argument("--reuse-samples", type=int, default=4, help="samples per task of the reuse comparison")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=512)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        folder = toy.make_model_folder(Path(tmp) / "model", texts=[haystack.reference_text()], vocab_size=args.vocab,
                                       hidden_size=args.hidden, num_layers=args.layers,
                                       max_position_embeddings=4 * args.reuse_length)
        print(f"model and tokenizer built in {time.perf_counter() - start:.1f} s", flush=True)
        info = longctx.load_eval_model(folder)
        building = prompt_building(info.tokenizer, longctx.parse_lengths(args.lengths), args.samples)
        reuse = prefix_reuse(info.model, info.tokenizer, args.reuse_length, args.reuse_samples, args.repeats,
                             args.chunk)
    print(f"prefix reuse at {reuse['length']}: {reuse['computed_tokens_reuse']}/{reuse['prompt_tokens']} tokens "
          f"computed, {reuse['seconds_reuse']:.1f} s vs {reuse['seconds_fresh']:.1f} s ({reuse['speedup']:.2f}x)")
    path = write_results("ruler", {"config": vars(args), "prompt_building": building, "prefix_reuse": reuse})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
