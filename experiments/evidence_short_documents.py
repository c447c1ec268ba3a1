"""A supplement to the evidence protocol, added after its trials: the held-out documents too short for its target.

    python -m experiments.evidence_short_documents [--jobs N] [--work DIR]

The protocol registers the target-length perplexity over its held-out documents, but a document with fewer tokens
than the target window holds is not scored there (`pose_mlx.perplexity --min-doc-tokens`), so the registered column
is over fewer documents than registered. This scores each of those documents whole, in one window (BOS + all of its
tokens), by every run of the confirmation stage, with the run's target-length setup, and caches one JSON per run in
`results/real_model/protocol/supplement/` with the device that gave it. The report stage of `bench_evidence` then
shows these numbers, and the perplexity over all the held-out documents (token-weighted with the registered ones:
exp of the total NLL over the total scored tokens), as a supplement never pooled into a registered test.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from experiments.bench_evidence import (EVAL, SUPPLEMENT, device, ensure_trained, model_args, run_all, run_recorded,
                                       shared_arguments, with_winner)
from benchmarks.common import corpus, model_file
from experiments.protocol import load_protocol


def short_documents(protocol: dict, test: Path) -> list[Path]:
    """The held-out documents the registered target-length perplexity left out: the test folder is sorted longest
    first and `pose_mlx.perplexity` keeps the first documents long enough, so they are the last
    (registered - scored) of the registered ones, `scored` read from any run's registered record."""
    target, registered = protocol["target"], protocol["perplexity"]["target"]["documents"]
    records = sorted(EVAL.glob(f"*.ppl.{target}.json"))
    if not records:
        raise SystemExit(f"no registered {target}-token perplexity in {EVAL} yet: run bench_evidence first")
    scored = {json.loads(p.read_text())["documents"] for p in records}
    if len(scored) != 1:
        raise SystemExit(f"the registered records scored different numbers of documents: {sorted(scored)}")
    return sorted(test.iterdir())[scored.pop():registered]


def evaluate_whole(name: str, spec: dict, protocol: dict, gguf: Path, work: Path, folder: Path, docs: int) -> Path:
    """One run's cached JSON: `docs` documents of `folder`, each whole in one target-length window."""
    path = SUPPLEMENT / f"{name}.ppl_whole.{protocol['target']}.json"
    if path.is_file():
        return path
    target = str(protocol["target"])
    cmd = ["pose_mlx.perplexity", *model_args(name, spec, protocol, gguf, work), "--data", str(folder),
           "--lengths", target, "--stride", target, "--docs", str(docs), "--min-doc-tokens", "1", "--no-truncate"]
    run_recorded(cmd, path, work / "logs" / f"supplement.{name}.log")
    for png in path.parent.glob(path.stem + "*.png"):
        png.unlink()  # one window per document: nothing to plot
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    shared_arguments(p)  # the same --work as bench_evidence: its corpus and model folders
    p.add_argument("--jobs", type=int, default=1, help="evaluations run at once, each its own process (default 1)")
    args = p.parse_args(argv)
    protocol = with_winner(load_protocol(args.protocol))
    gguf = model_file()
    train, test = corpus(args.work, protocol["perplexity"]["target"]["documents"], args.docs)
    short = short_documents(protocol, test)
    if not short:
        print("every held-out document reaches the target: nothing to add")
        return 0
    folder = args.work / "corpus" / "short"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for doc in short:
        shutil.copyfile(doc, folder / doc.name)
    print(f"device: {device()}; scoring whole: {', '.join(d.name for d in short)}", flush=True)
    for name, spec in protocol["runs"].items():  # one at a time: the controls share one model folder
        if spec["role"] in ("control", "pose"):
            ensure_trained(name, spec, protocol, gguf, args.work, train)
    failed = run_all([(n, spec, protocol, gguf, args.work, folder, len(short))
                      for n, spec in protocol["runs"].items()], evaluate_whole, args.jobs, label=1)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
