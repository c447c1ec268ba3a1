"""Short-context regression of the real-model runs: 40 one-line factual questions, greedy chat answers.

The analogue, for an instruct model small enough for a CPU with few cores, of PoSE's Table 3 (standard short
benchmarks before and after extension): does an extension change what the model answers when the context is short? Each
question is asked alone in the model's chat template; an answer is correct when it contains one of the
reference strings (case-insensitive). The questions are written for this benchmark, with short unambiguous
answers a 135M instruct model knows at least in part.

  python -m experiments.short_qa                      # every run of bench_real_model (PoSE runs once trained)
  python -m experiments.short_qa --only none --only yarn

Writes benchmarks/results/real_model/eval/<run>.short_qa.json (under --results: another folder of
bench_real_model): "accuracy", "correct", "questions", "answers" and `common.write_results`' record of the date,
versions and machine; bench_real_model's report collects them.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from benchmarks.common import POSE, REAL_MODEL, TARGET, TRAINING_FREE, model_file, write_results

QUESTIONS = [
    ("What is the capital of France?", ["Paris"]),
    ("What is the capital of Italy?", ["Rome"]),
    ("What is the capital of Japan?", ["Tokyo"]),
    ("What is the capital of Germany?", ["Berlin"]),
    ("What is the capital of Spain?", ["Madrid"]),
    ("What is the capital of the United Kingdom?", ["London"]),
    ("What is the capital of Russia?", ["Moscow"]),
    ("What is the capital of Egypt?", ["Cairo"]),
    ("Which planet is known as the Red Planet?", ["Mars"]),
    ("What is the largest planet in our solar system?", ["Jupiter"]),
    ("Which planet is closest to the Sun?", ["Mercury"]),
    ("What star is at the centre of our solar system?", ["Sun"]),
    ("What is the chemical symbol for water?", ["H2O", "H₂O"]),
    ("What gas do plants absorb from the air for photosynthesis?", ["carbon dioxide", "CO2", "CO₂"]),
    ("What gas do humans need to breathe to live?", ["oxygen"]),
    ("What is the boiling point of water in degrees Celsius at sea level?", ["100"]),
    ("What is the freezing point of water in degrees Celsius?", ["0", "zero"]),
    ("How many days are there in a week?", ["7", "seven"]),
    ("How many months are there in a year?", ["12", "twelve"]),
    ("How many legs does a spider have?", ["8", "eight"]),
    ("How many continents are there on Earth?", ["7", "seven"]),
    ("What is 2 + 2?", ["4", "four"]),
    ("What is 10 times 10?", ["100", "hundred"]),
    ("What is the largest ocean on Earth?", ["Pacific"]),
    ("What is the longest river in Africa?", ["Nile"]),
    ("Which animal is known as the king of the jungle?", ["lion"]),
    ("What is the largest mammal in the world?", ["whale"]),
    ("What colour is the sky on a clear day?", ["blue"]),
    ("What colour do you get when you mix blue and yellow?", ["green"]),
    ("Who wrote the play Romeo and Juliet?", ["Shakespeare"]),
    ("Who painted the Mona Lisa?", ["Leonardo", "da Vinci"]),
    ("Who developed the theory of relativity?", ["Einstein"]),
    ("What language is mainly spoken in Brazil?", ["Portuguese"]),
    ("What language is mainly spoken in Mexico?", ["Spanish"]),
    ("In which country are the pyramids of Giza?", ["Egypt"]),
    ("What is the tallest mountain in the world?", ["Everest"]),
    ("What is the opposite of hot?", ["cold"]),
    ("What is frozen water called?", ["ice"]),
    ("What do bees make?", ["honey"]),
    ("Which programming language is named after a comedy group and has a snake logo?", ["Python"]),
]


def ask(model, tokenizer, question: str, max_tokens: int) -> str:
    """The greedy chat answer to one question."""
    from mlx_lm import generate

    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    return generate(model, tokenizer, prompt, max_tokens=max_tokens)


def correct(answer: str, references: list[str]) -> bool:
    """A reference occurs in the answer, case-insensitive, not inside a longer word or number (a suffix such as
    a plural is allowed, a further digit is not: "0" does not match "100", "lion" matches "lions")."""
    return any(re.search(rf"(?<!\w){re.escape(ref)}(?!\d)", answer, re.IGNORECASE) for ref in references)


def evaluate(name: str, gguf: Path, work: Path, max_tokens: int, results: Path) -> Path:
    """Ask every question of run `name` (loaded as the evaluators load it); cached in
    <results>/eval/<name>.short_qa.json."""
    from pose_mlx.eval.longctx import load_eval_model

    path = results / "eval" / f"{name}.short_qa.json"
    if path.is_file():
        return path
    if name in POSE:
        info = load_eval_model(str(work / "runs" / name))
    elif name == "none":
        info = load_eval_model(str(gguf))
    else:
        info = load_eval_model(str(gguf), name, str(TARGET))
    t0 = time.perf_counter()
    answers = [ask(info.model, info.tokenizer, q, max_tokens) for q, _ in QUESTIONS]
    hits = [correct(a, refs) for a, (_, refs) in zip(answers, QUESTIONS)]
    return write_results("short_qa", {"run": name, "schedule": info.schedule, "accuracy": sum(hits) / len(hits),
                                      "correct": sum(hits), "questions": len(hits), "max_tokens": max_tokens,
                                      "seconds": time.perf_counter() - t0,
                                      "answers": [{"question": q, "references": refs, "answer": a, "correct": h}
                                                  for (q, refs), a, h in zip(QUESTIONS, answers, hits)]}, path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=Path("out/real_model"), help="bench_real_model's --work")
    p.add_argument("--results", type=Path, default=REAL_MODEL, help="bench_real_model's --results")
    p.add_argument("--only", action="append", default=None, help="only these runs (repeatable)")
    p.add_argument("--max-tokens", type=int, default=24, help="answer budget in tokens (default 24)")
    args = p.parse_args()
    import pose_mlx  # noqa: F401  (the fast BLAS first)

    gguf = model_file()
    for name in (*TRAINING_FREE, *POSE):
        if args.only and name not in args.only:
            continue
        if name in POSE and not (args.work / "runs" / name).is_dir():
            print(f"{name}: not trained yet, skipped", flush=True)
            continue
        record = json.loads(evaluate(name, gguf, args.work, args.max_tokens, args.results).read_text())
        print(f"{name}: {record['correct']}/{record['questions']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
