"""llama.cpp runs the GGUF file pose_mlx exports: SmolLM2-135M-Instruct extended 8k -> 32k with YaRN, side by side
with the MLX folder it was written from.

1. `python -m pose_mlx.finetune --sampler none --schedule yarn --target 32k --export-gguf f32` on the SmolLM2 GGUF
   file (read by pose_mlx's own reader): the extended folder (no training) and `<folder>.gguf`; `python -m
   pose_mlx.convert FOLDER X.gguf --outtype f16` for the f16 file.
2. Next-token logits over `--tokens` tokens of English prose (the Python tutorial, Debian's python3.11-doc: BOS,
   then its files in name order), the same token ids fed to both: the MLX folder through chunked prefill, each
   GGUF file through llama.cpp (llama-cpp-python, `n_ctx` = the document, its default f16 KV cache). Measured: the
   share of positions whose top-1 token agrees, the perplexity on each side, the largest logit difference and
   the mean KL divergence on every 128th position; and whether llama.cpp's own tokenizer gives the same ids.
3. One passkey trial at `--tokens` (pose_mlx.eval.passkey's prompt builder, the needle at mid-depth, the same ids
   on both sides), greedy, 10 new tokens: both answers.

Goals (set before the run): top-1 agreement >= 99% and perplexities within 1% for every file; the passkey answers
reported (and whether they agree). Writes benchmarks/results/llama_cpp.json. Needs the `llamacpp` extra
(`pip install -e ".[llamacpp]"`); each side's 16k-token pass takes minutes on two cores.
"""

from __future__ import annotations

import argparse
import sys
import time
from importlib import metadata
from pathlib import Path

import numpy as np

from benchmarks.common import DOCS, ORIGINAL, RESULTS_DIR, TARGET, model_file, write_results

GOALS = {"top1_agreement_min": 0.99, "ppl_relative_difference_max": 0.01}
SAMPLE_EVERY = 128  # positions whose whole logit rows are compared
PASSKEY = {"depth": 0.5, "key": 58391}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_llama_cpp", description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, default=Path.home() / ".cache" / "pose_mlx" / "bench_llama_cpp",
                        help="where the extended folder and GGUF files go (default ~/.cache/pose_mlx/bench_llama_cpp)")
    parser.add_argument("--tokens", type=int, default=16384, help="document and passkey length (default 16384)")
    parser.add_argument("--outtypes", default="f32,f16", help="GGUF files to check (default f32,f16)")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads (default 2)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "llama_cpp.json", help="the record to write")
    return parser.parse_args(argv)


def export(work: Path, outtypes: list[str]) -> tuple[Path, dict[str, Path]]:
    """The YaRN-extended folder and its GGUF files, made by pose_mlx's own commands (kept between runs): f32 by
    `finetune --export-gguf f32` (`<folder>.gguf`), the others by `convert FOLDER X.gguf --outtype`."""
    from pose_mlx.convert import main as convert
    from pose_mlx.finetune import main as finetune

    folder = work / "smollm2-yarn-32k"
    files = {t: work / (f"{folder.name}.gguf" if t == "f32" else f"{folder.name}-{t}.gguf") for t in outtypes}
    if not (folder / "pose_mlx.json").is_file() or not (work / f"{folder.name}.gguf").is_file():
        code = finetune(["--model", str(model_file()), "--target", str(TARGET), "--original", str(ORIGINAL),
                         "--schedule", "yarn", "--sampler", "none", "--output", str(folder), "--export-gguf", "f32",
                         "--overwrite", "--no-progress"])
        if code:
            sys.exit(f"bench_llama_cpp: finetune failed with exit code {code}")
    for outtype, path in files.items():
        if not path.is_file() and convert([str(folder), str(path), "--outtype", outtype]):
            sys.exit(f"bench_llama_cpp: convert --outtype {outtype} failed")
    return folder, files


def document(tokenizer, tokens: int) -> tuple[str, list[int]]:
    """The tutorial's text and BOS + its first `tokens` - 1 token ids."""
    files = sorted((DOCS / "tutorial").glob("*.rst.txt"))
    if not files:
        sys.exit(f"bench_llama_cpp: {DOCS / 'tutorial'} is missing: apt-get install python3.11-doc")
    text = "\n\n".join(p.read_text() for p in files)
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < tokens - 1:
        sys.exit(f"bench_llama_cpp: the tutorial has only {len(ids)} tokens")
    return text, [tokenizer.bos_token_id] + list(ids[: tokens - 1])


def row_stats(logits: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(argmax, -log p(target)) of each row of float logits (float64 for the log-sum-exp)."""
    x = logits.astype(np.float64)
    top = x.max(axis=1)
    lse = top + np.log(np.exp(x - top[:, None]).sum(axis=1))
    return logits.argmax(axis=1), lse - x[np.arange(len(targets)), targets]


def mlx_side(folder: Path, ids: list[int]) -> dict:
    """Argmax and NLL at every position, and the logit rows at every SAMPLE_EVERY-th, of the MLX folder."""
    from mlx_lm.models.cache import make_prompt_cache

    from pose_mlx.eval.longctx import prefill
    from pose_mlx.model.source import load

    model, _ = load(str(folder))
    n = len(ids)
    targets = np.array(ids[1:] + [0])
    top, nll, rows = np.zeros(n, np.int64), np.zeros(n), {}

    def take(start: int, logits) -> None:
        block = np.array(logits)
        span = slice(start, start + len(block))
        top[span], nll[span] = row_stats(block, targets[span])
        for i in range(-start % SAMPLE_EVERY, len(block), SAMPLE_EVERY):
            rows[start + i] = block[i].copy()

    started = time.perf_counter()
    prefill(model, ids, make_prompt_cache(model), 512, take)
    return {"top": top, "nll": nll[:-1], "rows": rows, "seconds": time.perf_counter() - started}


def llama_cpp_model(path: Path, n_ctx: int, threads: int):
    import llama_cpp

    return llama_cpp.Llama(str(path), n_ctx=n_ctx, n_batch=512, n_ubatch=512, logits_all=True, n_threads=threads,
                           n_threads_batch=threads, verbose=False)


def llama_cpp_side(llm, ids: list[int]) -> dict:
    """The same statistics from llama.cpp's logits (its `scores`, one row per token evaluated)."""
    llm.reset()
    started = time.perf_counter()
    llm.eval(ids)
    seconds = time.perf_counter() - started
    n = len(ids)
    targets = np.array(ids[1:] + [0])
    top, nll = np.zeros(n, np.int64), np.zeros(n)
    for start in range(0, n, 1024):
        block = np.asarray(llm.scores[start:min(n, start + 1024)], dtype=np.float32)
        span = slice(start, start + len(block))
        top[span], nll[span] = row_stats(block, targets[span])
    rows = {i: np.asarray(llm.scores[i], dtype=np.float32) for i in range(0, n, SAMPLE_EVERY)}
    return {"top": top, "nll": nll[:-1], "rows": rows, "seconds": seconds}


def compare(ours: dict, theirs: dict) -> dict:
    """Top-1 agreement, perplexities, and on the sampled rows the largest |logit difference| and mean KL(ours ||
    theirs)."""
    ppl_mlx, ppl_cpp = float(np.exp(ours["nll"].mean())), float(np.exp(theirs["nll"].mean()))
    kl, diff = [], 0.0
    for i, a in ours["rows"].items():
        b = theirs["rows"][i]
        p, q = (np.exp(x - x.max()) / np.exp(x - x.max()).sum() for x in (a.astype(np.float64), b.astype(np.float64)))
        kl.append(float((p * (np.log(p + 1e-300) - np.log(q + 1e-300))).sum()))
        diff = max(diff, float(np.abs(a - b).max()))
    agreement = float((ours["top"][:-1] == theirs["top"][:-1]).mean())
    relative = abs(ppl_cpp / ppl_mlx - 1)
    return {"top1_agreement": agreement, "ppl_mlx": ppl_mlx, "ppl_llama_cpp": ppl_cpp,
            "ppl_relative_difference": relative, "max_abs_logit_difference": diff, "mean_kl": float(np.mean(kl)),
            "positions_compared": len(ours["top"]) - 1, "rows_compared": len(kl),
            "seconds_llama_cpp": theirs["seconds"],
            "passes": agreement >= GOALS["top1_agreement_min"] and relative <= GOALS["ppl_relative_difference_max"]}


def greedy_llama_cpp(llm, prompt: list[int], max_new: int, stop: set[int]) -> list[int]:
    llm.reset()
    llm.eval(prompt)
    out = []
    while len(out) < max_new:
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        if token in stop:
            break
        out.append(token)
        llm.eval([token])
    return out


def passkey_prompt(tokenizer, tokens: int) -> tuple[list[int], set[int]]:
    """pose_mlx's passkey prompt of `tokens` tokens (the needle at PASSKEY's depth) and the tokens that stop."""
    from pose_mlx.eval.passkey import build_prompt

    prompt = build_prompt(tokenizer, tokenizer.bos_token_id, tokens, PASSKEY["depth"], PASSKEY["key"])
    return prompt, set(tokenizer.eos_token_ids or []) | {tokenizer.eos_token_id}


def answer(tokenizer, tokens: list[int], seconds: float) -> dict:
    from pose_mlx.eval.passkey import parse_answer

    text = tokenizer.decode(tokens)
    return {"answer": text, "correct": parse_answer(text) == PASSKEY["key"], "seconds": seconds}


def mlx_passkey(folder: Path, tokens: int) -> dict:
    from pose_mlx.eval.passkey import MAX_NEW_TOKENS, PrefixCachedGenerator
    from pose_mlx.model.source import load

    model, tokenizer = load(str(folder))
    prompt, stop = passkey_prompt(tokenizer, tokens)
    started = time.perf_counter()
    out = PrefixCachedGenerator(model).generate(prompt, MAX_NEW_TOKENS, stop)
    return {"prompt_tokens": len(prompt), **answer(tokenizer, out, time.perf_counter() - started)}


def llama_cpp_passkey(llm, tokenizer, tokens: int) -> dict:
    from pose_mlx.eval.passkey import MAX_NEW_TOKENS

    prompt, stop = passkey_prompt(tokenizer, tokens)
    started = time.perf_counter()
    out = greedy_llama_cpp(llm, prompt, MAX_NEW_TOKENS, stop)
    return answer(tokenizer, out, time.perf_counter() - started)


def main(argv=None) -> int:
    args = parse_args(argv)
    import pose_mlx  # noqa: F401  (the fast BLAS before MLX)

    try:
        import llama_cpp
    except ImportError:
        sys.exit("bench_llama_cpp: llama-cpp-python is not installed: pip install -e '.[llamacpp]'")
    from pose_mlx.model.gguf import read_header
    from pose_mlx.model.source import load

    outtypes = args.outtypes.split(",")
    args.work.mkdir(parents=True, exist_ok=True)
    folder, files = export(args.work, outtypes)
    tokenizer = load(str(folder))[1]
    text, ids = document(tokenizer, args.tokens)
    say(f"MLX over {len(ids)} tokens")
    ours = mlx_side(folder, ids)
    say("MLX passkey")
    passkey = {"mlx": mlx_passkey(folder, args.tokens)}
    logits, same_ids = {}, None
    for outtype, path in files.items():
        say(f"llama.cpp {outtype} over {len(ids)} tokens")
        llm = llama_cpp_model(path, args.tokens + 64, args.threads)
        if same_ids is None:
            same_ids = llm.tokenize(text.encode(), add_bos=False, special=False)[: len(ids) - 1] == ids[1:]
        logits[outtype] = compare(ours, llama_cpp_side(llm, ids))
        say(f"llama.cpp {outtype}: {logits[outtype]}; passkey")
        passkey[f"llama.cpp {outtype}"] = llama_cpp_passkey(llm, tokenizer, args.tokens)
        del llm
    header = read_header(files[outtypes[0]]).metadata
    record = {
        "what": "SmolLM2-135M-Instruct (Q4_1 GGUF read by pose_mlx) extended 8k -> 32k with YaRN, no training, "
                "exported to GGUF by pose_mlx and run by llama.cpp, against the MLX folder",
        "goals": GOALS, "tokens": len(ids), "document": "the Python tutorial (python3.11-doc), files in name order",
        "gguf_rope_keys": {k: v for k, v in header.items() if ".rope." in k or k.endswith("context_length")},
        "llama_cpp": {"llama_cpp_python": metadata.version("llama-cpp-python"), "n_ctx": args.tokens + 64,
                      "threads": args.threads, "kv_cache": "f16 (llama.cpp's default)",
                      "system_info": llama_cpp.llama_print_system_info().decode().strip()},
        "seconds_mlx": ours["seconds"], "logits": logits,
        "passkey": {**PASSKEY, "prompt_tokens": passkey["mlx"].pop("prompt_tokens"), "runs": passkey,
                    "same_answer": len({r["answer"] for r in passkey.values()}) == 1},
        "llama_cpp_tokenizer_same_ids": same_ids,
        "passes": all(r["passes"] for r in logits.values()),
    }
    path = write_results("llama_cpp", record, args.out)
    print(f"wrote {path}: passes={record['passes']}, passkey {passkey}")
    return 0 if record["passes"] else 1


def say(what: str) -> None:
    print(f"bench_llama_cpp: {what} ...", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
