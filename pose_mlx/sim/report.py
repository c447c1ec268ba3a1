"""report.md and PNGs from results.json's dict (tables shaped like the PoSE paper's)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import shutil

from ..plots import curves, line_vs_length, trials_note
from .agreement import ranking

#: (file stem, title, runs) of each perplexity table / figure.
TABLES = (
    ("ppl_main", "Perplexity of the baselines and PoSE (cf. paper Table 1)",
     ("original", "only-linear", "full-linear", "randpos-linear", "pose-linear")),
    ("ppl_schedules", "PoSE and full-length with each RoPE schedule (cf. paper Table 6)",
     ("only-linear", "only-ntk", "only-yarn", "full-linear", "full-ntk", "full-yarn", "pose-linear", "pose-ntk",
      "pose-yarn")),
    ("ppl_chunks", "Chunk-number ablation N, RandPos as its extreme (cf. paper Table 5)",
     ("pose-linear-n1", "pose-linear", "pose-linear-n3", "randpos-linear")),
    ("ppl_content", "Content offsets v_i ablation (cf. paper Table 4)", ("pose-linear", "pose-linear-zero",
                                                                        "pose-linear-aligned")),
)

#: Runs drawn in the per-position NLL figure, and whose passkey depth x length heatmaps the report shows.
NLL_RUNS = ("original", "only-linear", "only-yarn", "full-linear", "pose-linear", "full-yarn", "pose-yarn",
            "randpos-linear")
#: The cost figures' names of the training methods (keys of results["cost_vs_target"]).
METHOD_LABELS = {"pose": "PoSE (Lc-token sequences)", "full": "full-length (Lt-token sequences)"}
HEATMAP_RUNS = ("original", "only-linear", "pose-linear", "full-linear", "pose-yarn")


def _runs(results: dict, names) -> list[str]:
    window = results["config"]["window"]
    names = [n.format(window=window) for n in names]
    return list(dict.fromkeys(n for n in names if n in results["runs"]))


def _label(results: dict, name: str) -> str:
    return results["runs"][name]["spec"]["label"]


def metric_table(results: dict, names, key: str, fmt: str) -> str:
    lengths = results["config"]["lengths"]
    lines = ["| model | " + " | ".join(map(str, lengths)) + " |", "|---|" + "---|" * len(lengths)]
    for name in names:
        values = results["runs"][name][key]
        lines.append(f"| {_label(results, name)} | "
                     + " | ".join(format(values[str(n)], fmt) if str(n) in values else "-" for n in lengths) + " |")
    return "\n".join(lines)


def cost_table(results: dict) -> str:
    lines = ["| method | target | s / step | tokens / step | peak memory (GiB) |", "|---|---|---|---|---|"]
    for method, rows in results.get("cost_vs_target", {}).items():
        for target in sorted(rows, key=int):
            r = rows[target]
            lines.append(f"| {method} | {target} | {r['seconds_per_step']:.3f} | {r['tokens_per_step']} | "
                         f"{r['peak_memory_gb']:.3f} |")
    return "\n".join(lines)


def plots(results: dict, folder: Path) -> list[Path]:
    folder = Path(folder)
    lengths, window = results["config"]["lengths"], results["config"]["window"]
    out = []
    for stem, title, names in TABLES:
        names = [n for n in _runs(results, names) if results["runs"][n]["ppl"]]
        if names:
            series = {_label(results, n): [results["runs"][n]["ppl"].get(str(L), float("nan")) for L in lengths]
                      for n in names}
            out.append(line_vs_length(folder / f"{stem}.png", lengths, series, "perplexity (log scale)",
                                      "\n".join(textwrap.wrap(title, 50)),
                                      log_y=True, mark=window))
    keys = [n for n in ("original", "only-linear", "full-linear", "randpos-linear", "pose-linear", "pose-yarn")
            if results["runs"].get(n, {}).get("passkey")]
    if keys:
        tested = sorted({int(L) for n in keys for L in results["runs"][n]["passkey"]})
        series = {_label(results, n): [results["runs"][n]["passkey"].get(str(L), float("nan")) for L in tested]
                  for n in keys}
        out.append(line_vs_length(folder / "passkey.png", tested, series, "accuracy (share of trials)",
                                  f"Passkey retrieval (cf. paper Figure 2b), "
                                  f"{trials_note([results['config']['passkey_trials']])}", ylim=(-0.05, 1.05),
                                  mark=window))
    nll = results.get("nll_by_position") or {}
    shown = [n for n in NLL_RUNS if n in nll]
    if shown:
        series = {_label(results, n): (nll[n]["positions"], nll[n]["nll"]) for n in shown}
        out.append(curves(folder / "nll_by_position.png", series, f"position in a window of {results['config']['target']}"
                          f" tokens (first of a bin of {nll[shown[0]]['bin_width']})", "mean NLL (nats)",
                          "Per-position NLL on the test documents", mark=window))
    for name in HEATMAP_RUNS:  # the heatmaps pose_mlx.passkey wrote, next to the report
        source = folder / "eval" / f"{name}.passkey_heatmap.png"
        if source.is_file():
            out.append(Path(shutil.copyfile(source, folder / f"passkey_heatmap_{name}.png")))
    cost = results.get("cost_vs_target", {})
    for key, ylabel in (("seconds_per_step", "seconds per update (s)"), ("peak_memory_gb", "peak memory (GiB)")):
        targets = sorted({int(t) for rows in cost.values() for t in rows})
        if targets:
            series = {METHOD_LABELS.get(m, m): [rows.get(str(t), {}).get(key, float("nan")) for t in targets]
                      for m, rows in cost.items()}
            out.append(line_vs_length(folder / f"cost_{key.split('_')[0]}.png", targets, series, ylabel,
                                      "Training cost vs target length (cf. paper Figure 3)",
                                      xlabel="target length Lt (tokens)"))
    return out


def ruler_section(results: dict) -> list[str]:
    """RULER's subset (`pose_mlx.ruler`, plain prompts): score per run, task and length ('-': does not fit)."""
    table = results.get("ruler") or {}
    if not table:
        return []
    lengths = results["config"]["lengths"]
    lines = ["### RULER subset", "", f"`pose_mlx.ruler --no-chat`, {results['config']['ruler_samples']} samples per "
             "task and length; '-' where the task's template and needles do not fit the length.", "",
             "| run | task | " + " | ".join(map(str, lengths)) + " |", "|---|---|" + "---|" * len(lengths)]
    for name, tasks in table.items():
        for task, scores in tasks.items():
            lines.append(f"| {_label(results, name)} | {task} | "
                         + " | ".join(f"{scores[str(n)]:.2f}" if str(n) in scores else "-" for n in lengths) + " |")
    return lines + [""]


def gates_section(results: dict) -> list[str]:
    """The base model's gates (`pose_mlx.sim.gates`): does it behave like a small real LLM?"""
    g, c = results.get("gates"), results["config"]
    if not g:
        return []
    passkey = g["passkey_at_lc"]
    verdict = "not testable (the prompt template does not fit Lc)" if passkey is None else (
        f"{passkey:.2f} over {g['passkey_trials']} trials: "
        + ("**held**" if passkey >= g["passkey_threshold"] else "**did not hold**"))
    return ["## The base model", "",
            "| gate | value |", "|---|---|",
            f"| passkey accuracy at Lc = {c['window']} (needs >= {g['passkey_threshold']:.2f}) | {verdict} |",
            f"| perplexity at Lc (validation) | {results['pretrain']['val_ppl']:.2f} |",
            f"| no-context perplexity (each test token after BOS only) | {g['no_context_ppl']:.1f} |",
            f"| unigram perplexity of the test text (add-one, training counts) | {g['unigram_ppl']:.1f} |",
            f"| attention on the first token (mean over layers, heads, queries) | {g['sink_share']:.3f} |",
            *_far_attention_row(g, c), ""]


def _far_attention_row(g: dict, c: dict) -> list[str]:
    far = g.get("far_attention")  # gates measured before it existed have none
    if not far:
        return []
    return [f"| at Lt = {c['target']}: attention of the last Lc / 2 queries on tokens >= Lc back (uniform: "
            f"{far['uniform_share']:.2f}); largest logit there minus the largest nearer | {far['far_share']:.2f}; "
            f"{far['far_logit_excess']:+.2f} |"]


def _finetune_data(results: dict) -> str:
    data = results.get("finetune_data") or {}
    if not data:
        return "no retrieval documents in the fine-tuning data"
    parts = ", ".join(f"{d['retrieval_documents']} of {n} tokens" for n, d in sorted(data.items(), key=lambda x: int(x[0])))
    share = next(iter(data.values()))["share"]
    return (f"a share {share:g} of every method's fine-tuning documents are synthetic retrieval documents of its "
            f"example length ({parts}; none where the task does not fit)")


def seeds_table(results: dict) -> list[str]:
    """Claim (b)'s numbers: mean and 95% interval over the seeds of the PoSE and full-length runs."""
    table, lengths = results.get("ppl") or {}, results["config"]["lengths"]
    names = [n for n in ("full-linear", "pose-linear", "full-ntk", "pose-ntk", "full-yarn", "pose-yarn") if n in table]
    if not names:
        return []
    lines = [f"### Over seeds {results['config'].get('seeds')}", "",
             "Mean perplexity and half-width of its 95% interval (Student t over the seeds).", "",
             "| model | " + " | ".join(map(str, lengths)) + " |", "|---|" + "---|" * len(lengths)]
    for name in names:
        cells = []
        for n in lengths:
            row = table[name].get(str(n))
            cells.append("-" if row is None else f"{row['mean']:.2f}" + (
                "" if row["ci95"] is None else f" +- {row['ci95']:.2f}"))
        lines.append(f"| {_label(results, name)} | " + " | ".join(cells) + " |")
    return lines + [""]


AGREEMENT_HEADING = "## Agreement with the real model"


def agreement_section(results: dict) -> list[str]:
    """The simulator's job: the real model's ranking of the methods (`pose_mlx.sim.agreement`), both rankings
    side by side with Kendall's tau-b and whether it reaches the goal."""
    a = results.get("sim_agreement")
    if not a:
        return []
    measures = (("ppl", "perplexity", ".2f"), ("passkey", "passkey accuracy", ".2f"))
    lines = [AGREEMENT_HEADING, "",
             "The simulator's job is to predict how the real model (SmolLM2-135M-Instruct, 8k -> 32k; "
             "`benchmarks/results/real_model/results.json`) ranks the methods. Over the "
             f"{len(a['methods'])} methods both have measured, each at its own target (here Lt = "
             f"{a['sim_target']}, the real model {a['real_target']}), Kendall's tau-b between the two rankings "
             f"(goal >= {a['goal']:g} on both; rank 1 is the best, tied methods share their mean rank). The real "
             "model's numbers are its pre-registered protocol's (confirmation stage) where it has them, else its "
             "exploratory stage's; new runs and numbers there are picked up when the report is made again.", ""]
    if len(a["methods"]) < 2:
        return lines + ["Fewer than two methods are measured by both: nothing to rank.", ""]
    head, rule = ["method"], ["---"]
    for key, title, _ in measures:
        head += [f"simulator {title} @ {a['sim_target']} (rank)", f"real {title} @ {a['real_target']} (rank)"]
        rule += ["---", "---"]
    lines += ["| " + " | ".join(head) + " | real numbers from |", "|" + "|".join(rule) + "|---|"]
    ranks = {(side, key): _ranks(a[side][key], key) for side in ("sim", "real") for key, _, _ in measures}
    for name in a["methods"]:
        cells = [name]
        for key, _, fmt in measures:
            cells += [f"{a[side][key][name]:{fmt}} ({ranks[side, key][name]:g})" for side in ("sim", "real")]
        sources = sorted(set(a["real_source"][name].values()))
        lines.append("| " + " | ".join(cells) + f" | {', '.join(sources)} |")
    lines.append("")
    for key, title, _ in measures:
        tau = a[f"{key}_tau"]
        text = "undefined (one side scores every method alike)" if tau is None else f"{tau:.2f}"
        verdict = "reaches" if tau is not None and tau >= a["goal"] else "does not reach"
        order = {side: _order(a[side][key], key) for side in ("sim", "real")}
        lines += [f"- {title.capitalize()}: tau = {text}, {verdict} the goal. Simulator {order['sim']}; "
                  f"real model {order['real']}."]
    lines += ["", f"**The goal {'holds' if a['holds'] else 'does not hold'}** (tau >= {a['goal']:g} on both).", ""]
    return lines


def _ranks(scores: dict, measure: str) -> dict:
    out, position = {}, 1
    for group in ranking(scores, measure):
        for name in group:
            out[name] = position + (len(group) - 1) / 2
        position += len(group)
    return out


def _order(scores: dict, measure: str) -> str:
    return (" < " if measure == "ppl" else " > ").join(" = ".join(g) for g in ranking(scores, measure))


def _wall_time(results: dict) -> str:
    """The run's cost from scratch (each stage's own time, whichever invocation ran it) and this invocation's."""
    whole, own = results["wall_seconds"], results.get("wall_seconds_this_process", results["wall_seconds"])
    missing = results.get("stages_without_time", [])
    text = (f"Wall time of the whole run: {whole / 60:.1f} min (every stage once, timed when it ran); this invocation "
            f"{own / 60:.1f} min (cached stages are not re-run).")
    if missing:
        text += (f" {len(missing)} stages ran before their times were kept, so the whole run took longer than "
                 "that.")
    pre = results["pretrain"]
    if "reused_from" in pre:
        source = ("the shipped base `pose_mlx/sim/pretrained`" if pre["reused_from"] == "shipped"
                  else f"`{pre['reused_from']}`")
        text += (f" Not counted: pre-training, whose base was copied from {source} (made with these "
                 f"settings on this corpus; its pre-training took {pre['seconds'] / 60:.0f} min).")
    return text


def write_report(results: dict, folder: Path, pngs: list[Path]) -> Path:
    c, pre = results["config"], results["pretrain"]
    held = {True: "**held**", False: "**did not hold**", None: "not evaluated"}
    invocation = f"python -m pose_mlx.sim {results['argv']}".rstrip()
    parts = [
        "# PoSE simulator report", "",
        f"Command: `{invocation}`. {_wall_time(results)}", "",
        f"Model: llama, hidden {c['hidden']}, {c['layers']} layers, {c['heads']} heads, FFN {c['ffn']}, vocabulary "
        f"{c['vocab']}, {pre['parameters']:,} parameters, RoPE base {c['base']:.4g} (Lc / (2 pi base) = "
        f"{c['window'] / (6.283185307 * c['base']):.4f}, Llama-2: 0.0652). Pre-trained at Lc = {c['window']} on "
        f"{pre['train_tokens']:,} tokens ({pre['steps']} steps, {pre['retrieval_blocks']} of {pre['blocks']} blocks "
        f"are synthetic retrieval documents); validation perplexity {pre['val_ppl']:.2f}.", "",
        f"Grid: target Lt = {c['target']} ({c['factor']}x); every run is `pose_mlx.finetune --full` with "
        f"{c['steps']} updates of {c['full_batch']} x {c['target']} (full-length) or {c['window_batch']} x "
        f"{c['window']} tokens (other methods), lr {c['lr']:g}; "
        f"{_finetune_data(results)}. Corpus: {results['corpus']['source']} "
        f"({results['corpus']['documents']}); test = the {c['test_docs']} longest documents, first "
        f"{c['test_tokens']} tokens each.", "",
    ]
    parts += gates_section(results)
    parts += ["## Claims", ""]
    for claim in results["claims"]:
        parts.append(f"- ({claim['id']}) {claim['claim']}: {held[claim['held']]}. {claim['detail']}")
    parts += [""] + agreement_section(results)
    parts += ["## Perplexity", "",
              "Token-weighted sliding-window perplexity on the test documents (windows of BOS + W-1 tokens, "
              f"{c['eval_stride']} tokens apart; `pose_mlx.perplexity`).", ""]
    for stem, title, names in TABLES:
        names = _runs(results, names)
        if names:
            parts += [f"### {title}", "", metric_table(results, names, "ppl", ".2f"), "", f"![{stem}]({stem}.png)", ""]
    parts += seeds_table(results)
    nll = results.get("nll_by_position") or {}
    if nll:
        any_curve = next(iter(nll.values()))
        parts += ["### Per-position NLL", "", f"Mean NLL of the token at each position of non-overlapping windows of "
                  f"{c['target']} tokens ({any_curve['windows']} windows of the test documents), in bins of "
                  f"{any_curve['bin_width']} positions (`pose_mlx.sim.position_nll`). A ratio above 1: the model "
                  "predicts worse at the end of the window than anywhere within Lc.", "",
                  "| model | first bin | lowest bin within Lc | last bin | last / lowest within Lc |",
                  "|---|---|---|---|---|"]
        inside = max(1, c["window"] // any_curve["bin_width"])
        for name, curve in nll.items():
            low = min(curve["nll"][:inside])
            parts.append(f"| {_label(results, name)} | {curve['nll'][0]:.2f} | {low:.2f} | {curve['nll'][-1]:.2f} | "
                         f"{curve['nll'][-1] / low:.2f} |")
        parts += ["", "![nll_by_position](nll_by_position.png)", ""]
    passkey_runs = [n for n, r in results["runs"].items() if r["passkey"]]
    parts += ["## Passkey retrieval", "", f"Accuracy over {c['passkey_trials']} trials per length "
              "(`pose_mlx.passkey`; lengths shorter than the prompt template are not tested).", ""]
    if passkey_runs:
        parts += [metric_table(results, passkey_runs, "passkey", ".2f"), "", "![passkey](passkey.png)", ""]
    heatmaps = [p for p in pngs if p.stem.startswith("passkey_heatmap_")]
    if heatmaps:
        parts += ["Accuracy by needle depth (rows) and length (columns), per run:", ""]
        parts += [f"![{p.stem}]({p.name})" for p in heatmaps] + [""]
    parts += ruler_section(results)
    parts += ["## Cost", "", "Median seconds per update (first update left out) and peak memory of training, "
              f"with {c['full_batch']} sequences per update for both methods: Lc tokens each for PoSE, Lt for "
              "full-length (cf. paper Figure 3).", "", cost_table(results), ""]
    parts += [f"![{p.stem}]({p.name})" for p in pngs if p.stem.startswith("cost_")]
    path = Path(folder) / "report.md"
    path.write_text("\n".join(parts) + "\n")
    return path
