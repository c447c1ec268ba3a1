"""The paper's qualitative claims (a)-(f), checked on results.json's numbers with fixed, stated thresholds.

Each check returns {"id", "claim", "held": True/False/None (not evaluable: a number is missing), "detail"}
with the numbers that decided it. Thresholds are module constants, never tuned per run.
"""

from __future__ import annotations

EXPLODE = 10.0  # (a) "explodes": ppl at some length > Lc is >= 10x its ppl at Lc, or above the unigram ppl
WITHIN = 0.05  # (b) PoSE within +-5% of full-length
PASSKEY_OK, PASSKEY_ZERO, PASSKEY_BASE = 0.90, 0.10, 0.95  # (c) PoSE >= 90%, Original <= 10% from 2 Lc, >= 95% at Lc
FAILS = 1.10  # (d) N=1 "fails": ppl >= 1.10 x PoSE (N=2) at some length > Lc
HURTS = 1.05  # (d) RandPos "hurts at Lc": ppl at Lc >= 1.05 x PoSE (N=2)
SCHEDULES = ("linear", "ntk", "yarn")
FLAT, GROWS = 1.25, 1.5  # (e) PoSE max/min cost over targets <= 1.25; full-length cost at the largest / smallest >= 1.5
CLOSE = 0.10  # (f) "Full ~ PoSE": within 10%
MUCH = 1.5  # (f) ">>": Original ppl >= 1.5 x schedule-only ppl


#: Student's t quantile t_{0.975, df} for df = 1 .. 10 (two-sided 95% intervals of a mean over few seeds).
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def mean_ci95(values: list[float]) -> tuple[float, float | None]:
    """(mean, half-width of its 95% interval t_{0.975, n-1} s / sqrt(n)); None for one value. n > 11: t ~ 1.96."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, None
    sd = (sum((v - mean) ** 2 for v in values) / (n - 1)) ** 0.5
    return mean, (T975[n - 2] if n <= 11 else 1.96) * sd / n ** 0.5


def seed_statistics(runs: dict, seeded: dict) -> dict:
    """results.json's `ppl[run][length] = {"mean", "ci95", "values"}`: over seeds for the runs in `seeded`
    ({run: {seed: {length: ppl}}}), the one value of every other run (ci95 None)."""
    table = {}
    for name, entry in runs.items():
        per_seed = seeded.get(name) or {0: entry["ppl"]}
        table[name] = {}
        for length in entry["ppl"]:
            values = [ppl[length] for ppl in per_seed.values() if length in ppl]
            mean, ci = mean_ci95(values)
            table[name][length] = {"mean": mean, "ci95": ci, "values": values}
    return table


def _ppl(results: dict, run: str, length: int):
    """Perplexity of `run` at `length`: the mean over seeds (results['ppl']) when present, else the run's own."""
    if "ppl" in results:
        return results["ppl"].get(run, {}).get(str(length), {}).get("mean")
    return results["runs"].get(run, {}).get("ppl", {}).get(str(length))


def _ci(results: dict, run: str, length: int) -> str:
    ci = results.get("ppl", {}).get(run, {}).get(str(length), {}).get("ci95")
    return "" if ci is None else f" +- {ci:.2g}"


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def _claim(cid: str, text: str, held, detail: str) -> dict:
    return {"id": cid, "claim": text, "held": held, "detail": detail}


def claim_a(results: dict, lengths: list[int]) -> dict:
    unigram = results.get("unigram_ppl")
    text = (f"Original perplexity explodes beyond Lc (>= {EXPLODE:g}x its perplexity at Lc, or above the "
            "unigram perplexity of the same text, at some length <= Lt)")
    at_lc = _ppl(results, "original", lengths[0])
    beyond = {n: _ppl(results, "original", n) for n in lengths[1:]}
    if at_lc is None or None in beyond.values():
        return _claim("a", text, None, "missing perplexities of 'original'")
    ratios = {n: v / at_lc for n, v in beyond.items()}
    detail = (f"Original ppl {_fmt(at_lc)} at {lengths[0]}; ratio to it "
              + ", ".join(f"{n}: {r:.2f}x" for n, r in ratios.items())
              + f"; largest {_fmt(max(beyond.values()))} vs unigram {_fmt(unigram)}")
    above = unigram is not None and max(beyond.values()) > unigram
    return _claim("a", text, max(ratios.values()) >= EXPLODE or above, detail)


def claim_b(results: dict, lengths: list[int]) -> dict:
    text = (f"PoSE is within +-{WITHIN:.0%} of Full-length perplexity at every length <= Lt, for every schedule "
            f"({', '.join(SCHEDULES)})")
    pairs = {(s, n): (_ppl(results, f"pose-{s}", n), _ppl(results, f"full-{s}", n)) for s in SCHEDULES
             for n in lengths}
    if any(None in p for p in pairs.values()):
        return _claim("b", text, None, "missing perplexities of a 'pose-*' or 'full-*' run")
    gaps = {k: p / f - 1 for k, (p, f) in pairs.items()}
    seeds = results.get("config", {}).get("seeds", [0])
    detail = (f"mean over seeds {seeds} (95% interval): "
              + ", ".join(f"{s}@{n}: PoSE {p:.3g}{_ci(results, f'pose-{s}', n)} vs Full {f:.3g}"
                          f"{_ci(results, f'full-{s}', n)} ({gaps[s, n]:+.1%})" for (s, n), (p, f) in pairs.items()))
    return _claim("b", text, all(abs(g) <= WITHIN for g in gaps.values()), detail)


def claim_c(results: dict, lengths: list[int]) -> dict:
    """Judged on PoSE + YaRN (the recipe the real model uses); PoSE + PI's accuracies are reported beside it, the
    ablation that shows what linear interpolation costs the passkey."""
    text = (f"PoSE + YaRN passkey accuracy >= {PASSKEY_OK:.0%} at every length <= Lt, Original <= "
            f"{PASSKEY_ZERO:.0%} at every length >= 2 Lc and >= {PASSKEY_BASE:.0%} at Lc")
    pose = results["runs"].get("pose-yarn", {}).get("passkey", {})
    orig = results["runs"].get("original", {}).get("passkey", {})
    tested = [n for n in lengths if str(n) in pose]
    beyond = [n for n in tested if n >= 2 * lengths[0] and str(n) in orig]
    if not tested or not beyond or str(lengths[0]) not in orig:
        return _claim("c", text, None, "no passkey at Lc, or none beyond it: the prompt template does not fit")
    pi = results["runs"].get("pose-linear", {}).get("passkey", {})
    detail = ("PoSE + YaRN " + ", ".join(f"{n}: {pose[str(n)]:.2f}" for n in tested) + "; Original "
              + ", ".join(f"{n}: {orig[str(n)]:.2f}" for n in tested if str(n) in orig)
              + ("; PoSE + PI (ablation, not judged) " + ", ".join(f"{n}: {pi[str(n)]:.2f}" for n in tested
                                                                   if str(n) in pi) if pi else ""))
    held = (all(pose[str(n)] >= PASSKEY_OK for n in tested) and all(orig[str(n)] <= PASSKEY_ZERO for n in beyond)
            and orig[str(lengths[0])] >= PASSKEY_BASE)
    return _claim("c", text, held, detail)


def claim_d(results: dict, lengths: list[int]) -> dict:
    window = lengths[0]
    text = (f"N = 1 fails beyond Lc (>= {FAILS:g}x PoSE N=2 at some length > Lc) and RandPos hurts perplexity at "
            f"Lc (>= {HURTS:g}x PoSE N=2); N = 3 reported")
    one = {n: (_ppl(results, "pose-linear-n1", n), _ppl(results, "pose-linear", n)) for n in lengths[1:]}
    rand = (_ppl(results, "randpos-linear", window), _ppl(results, "pose-linear", window))
    if any(None in p for p in one.values()) or None in rand:
        return _claim("d", text, None, "missing perplexities of the chunk ablation or RandPos")
    ratios = {n: a / b for n, (a, b) in one.items()}
    hurt = rand[0] / rand[1]
    three = {n: _ppl(results, "pose-linear-n3", n) for n in lengths}
    detail = ("N=1 / N=2: " + ", ".join(f"{n}: {r:.2f}x" for n, r in ratios.items())
              + f"; RandPos / N=2 at {window}: {_fmt(rand[0])} / {_fmt(rand[1])} = {hurt:.2f}x; N=3: "
              + ", ".join(f"{n}: {_fmt(v)}" for n, v in three.items()))
    return _claim("d", text, max(ratios.values()) >= FAILS and hurt >= HURTS, detail)


def claim_e(results: dict) -> dict:
    text = (f"PoSE cost (time per step, peak memory) is flat in Lt (max/min <= {FLAT:g}) while Full-length "
            f"grows (largest/smallest target >= {GROWS:g})")
    table = results.get("cost_vs_target", {})
    pose, full = table.get("pose", {}), table.get("full", {})
    if len(pose) < 2 or len(full) < 2:
        return _claim("e", text, None, "fewer than two targets timed")
    parts, held = [], True
    for key, unit in (("seconds_per_step", "s/step"), ("peak_memory_gb", "GiB")):
        p = [pose[t][key] for t in sorted(pose, key=int)]
        f = [full[t][key] for t in sorted(full, key=int)]
        flat, grows = max(p) / min(p), f[-1] / f[0]
        held = held and flat <= FLAT and grows >= GROWS
        parts.append(f"{unit}: PoSE max/min {flat:.2f}, Full largest/smallest {grows:.2f}")
    return _claim("e", text, held, "; ".join(parts))


def claim_f(results: dict, lengths: list[int]) -> dict:
    text = (f"For each schedule, Full ~ PoSE (within {CLOSE:.0%}) > schedule-only >> Original "
            f"(>= {MUCH:g}x) at every length > Lc")
    held, parts = True, []
    for s in SCHEDULES:
        for n in lengths[1:]:
            full, pose = _ppl(results, f"full-{s}", n), _ppl(results, f"pose-{s}", n)
            only, orig = _ppl(results, f"only-{s}", n), _ppl(results, "original", n)
            if None in (full, pose, only, orig):
                return _claim("f", text, None, f"missing perplexities for schedule {s} at {n}")
            ok = abs(pose / full - 1) <= CLOSE and max(full, pose) < only and orig >= MUCH * only
            held = held and ok
            parts.append(f"{s}@{n}: Full {full:.3g}, PoSE {pose:.3g}, only {only:.3g}, Original {orig:.3g}"
                         f" ({'ok' if ok else 'fails'})")
    return _claim("f", text, held, "; ".join(parts))


def check_claims(results: dict) -> list[dict]:
    lengths = results["config"]["lengths"]
    return [claim_a(results, lengths), claim_b(results, lengths), claim_c(results, lengths),
            claim_d(results, lengths), claim_e(results), claim_f(results, lengths)]
