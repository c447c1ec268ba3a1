"""Statistics of the evaluation protocol against published values and hand counts, and the protocol file's
schema and stated power."""


import math

import numpy as np
import pytest
import yaml

from experiments.protocol import (PROTOCOLS, amend, checked_equivalence_power, checked_power, difference_tests,
                                  discordant, equivalence_tests, load_protocol, select_recipe)
from pose_mlx.analysis.stats import (Z90, difference_interval, equivalence, equivalence_power, equivalence_trials,
                                     kendall_tau, power, verdict, wilson)

# Newcombe (1998), Table II, method 10 (hybrid score), to the four decimals printed there.
NEWCOMBE = [((56, 70, 48, 80), (0.0524, 0.3339)), ((9, 10, 3, 10), (0.1705, 0.8090)),
            ((6, 7, 2, 7), (0.0582, 0.8062)), ((5, 56, 0, 29), (-0.0381, 0.1926)),
            ((0, 10, 0, 20), (-0.1611, 0.2775)), ((0, 10, 0, 10), (-0.2775, 0.2775)),
            ((10, 10, 0, 20), (0.6791, 1.0000)), ((10, 10, 0, 10), (0.6075, 1.0000))]


@pytest.mark.parametrize("counts, expected", NEWCOMBE)
def test_difference_interval_reproduces_newcombes_table(counts, expected):
    d, low, high = difference_interval(*counts)
    assert d == pytest.approx(counts[0] / counts[1] - counts[2] / counts[3])
    assert (round(low, 4), round(high, 4)) == expected


def test_difference_interval_is_antisymmetric_and_wilson_matches_its_formula():
    d, low, high = difference_interval(13, 16, 3, 4)
    d2, low2, high2 = difference_interval(3, 4, 13, 16)
    assert (d2, low2, high2) == pytest.approx((-d, -high, -low))
    # Wilson by hand for 13/16: p = 0.8125, z^2 = 3.8415
    z2 = 1.959963984540054 ** 2
    centre = (0.8125 + z2 / 32) / (1 + z2 / 16)
    half = 1.959963984540054 * math.sqrt(0.8125 * 0.1875 / 16 + z2 / 1024) / (1 + z2 / 16)
    assert wilson(13, 16) == pytest.approx((centre - half, centre + half))
    assert wilson(0, 10)[0] == 0.0 and wilson(10, 10)[1] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="hits"):
        wilson(11, 10)


def test_verdict_and_power():
    assert verdict(0.01, 0.4) == "better" and verdict(-0.4, -0.01) == "worse"
    assert verdict(-0.1, 0.3) == "not distinguishable"
    assert power(1.0, 10, 0.0, 10) == pytest.approx(1.0)  # 10/10 vs 0/10: (0.6075, 1.0) always
    assert power(0.5, 10, 0.5, 10) < 0.05  # no true difference: found at most at the test's level
    # a larger sample has more power at the same accuracies
    assert power(0.95, 24, 0.75, 24) < power(0.95, 60, 0.75, 60)


@pytest.mark.parametrize("x, y, tau", [([1, 2, 3, 4], [1, 3, 2, 4], 4 / 6),  # 5 concordant, 1 discordant pair
                                       ([1, 2, 3], [3, 2, 1], -1.0), ([5, 6, 7], [0.1, 0.2, 0.3], 1.0),
                                       # tau-b with one tie in y: C=2, D=0, T_y=1 -> 2 / sqrt(3 * 2)
                                       ([1, 2, 3], [1, 2, 2], 2 / math.sqrt(6))])
def test_kendall_tau_by_hand(x, y, tau):
    assert kendall_tau(x, y) == pytest.approx(tau)
    assert kendall_tau(y, x) == pytest.approx(tau)


def test_the_committed_protocol_loads_and_states_its_power_truly():
    protocol = load_protocol(PROTOCOLS / "real_model.yaml")
    assert protocol["passkey"]["trials"][32768] >= 24 and all(
        protocol["passkey"]["trials"][n] >= 30 for n in (4096, 8192, 16384))
    assert protocol["ruler"]["samples"] >= 5 and protocol["perplexity"]["target"]["documents"] >= 4
    assert checked_power(protocol) == pytest.approx(protocol["power_checked"]["power"], abs=0.005)


def test_protocol_schema_names_what_is_wrong(tmp_path):
    good = yaml.safe_load((PROTOCOLS / "real_model.yaml").read_text())
    for change, message in ((lambda p: p["runs"]["none"].update(role="oracle"), "role must be one of"),
                            (lambda p: p["passkey"].pop("seed"), "passkey.seed"),
                            (lambda p: p["test"]["lengths"].append(65536), "65536 has no passkey trials"),
                            (lambda p: p["passkey"]["trials"].update({8192: 0}), "positive counts"),
                            (lambda p: p["runs"].pop("pose-yarn-lr3e-5"), "at least one run of role pose")):
        bad = yaml.safe_load(yaml.safe_dump(good))
        change(bad)
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump(bad))
        with pytest.raises(ValueError, match=message):
            load_protocol(path)


def test_difference_tests_on_hand_made_counts():
    protocol = load_protocol(PROTOCOLS / "real_model.yaml")
    runs = {"pose-yarn-lr3e-5": {"passkey": {"16384": 27 / 30, "32768": 21 / 24},
                                 "passkey_trials": {"16384": 30, "32768": 24}},
            "dynamic": {"passkey": {"16384": 15 / 30, "32768": 18 / 24}, "passkey_trials": {"16384": 30, "32768": 24}},
            "adapt-yarn": {"passkey": {"16384": 28 / 30}, "passkey_trials": {"16384": 30}}}
    tests = {(t["length"], t["control"]): t for t in difference_tests(protocol, runs)}
    assert set(tests) == {(16384, "dynamic"), (16384, "adapt-yarn"), (32768, "dynamic")}
    t = tests[(16384, "dynamic")]
    assert t["difference"] == pytest.approx(0.4) and t["verdict"] == "better"
    assert t["ci95"] == pytest.approx(list(difference_interval(27, 30, 15, 30)[1:]))
    assert tests[(16384, "adapt-yarn")]["verdict"] == "not distinguishable"
    assert tests[(32768, "dynamic")]["counts"] == {"pose-yarn-lr3e-5": [21, 24], "dynamic": [18, 24]}
    a = [{"correct": c} for c in (1, 1, 0, 0, 1)]
    b = [{"correct": c} for c in (1, 0, 1, 0, 0)]
    assert discordant(a, b) == (2, 1)


def test_select_recipe_follows_the_registered_rule():
    """The screening's winner, by hand: qualified = 4k passkey >= 0.95 and unseen perplexity within 3% of the
    base's; among them the best 32k passkey, ties to the lower 32k perplexity; none qualified: the best 4k."""
    protocol = load_protocol(PROTOCOLS / "real_model.yaml")
    protocol["recipe"]["candidates"] = {"a": {}, "b": {}, "c": {}}

    def entry(p4, p32, unseen, ppl):
        return {"passkey": {4096: p4, 32768: p32}, "ppl_unseen": unseen, "ppl": ppl}

    numbers = {"a": entry(1.0, 0.6, 10.2, 5.0), "b": entry(0.9, 0.9, 10.0, 4.0), "c": entry(1.0, 0.6, 10.0, 4.5)}
    assert select_recipe(protocol, numbers, 10.0) == "c"  # b fails 4k; a and c tie at 32k, c has lower ppl
    numbers["a"]["ppl_unseen"] = 10.31  # 3.1% off the base: a no longer qualifies, c still wins
    assert select_recipe(protocol, numbers, 10.0) == "c"
    numbers["c"]["ppl_unseen"] = 9.6  # 4% *below* the base also breaks "within 3%": none qualifies -> best 4k
    assert select_recipe(protocol, numbers, 10.0) == "c"  # a and c tie at 4k (1.0); c has the lower 32k ppl
    numbers["a"]["passkey"][4096] = 0.8
    numbers["c"]["passkey"][4096] = 0.7
    assert select_recipe(protocol, numbers, 10.0) == "b"
    del numbers["b"]["ppl"], numbers["a"]["passkey"][32768]
    assert select_recipe(protocol, numbers, 10.0) == "b"  # alone at the top at 4k: its 32k numbers cannot matter
    numbers["a"]["passkey"][4096] = 0.9
    assert select_recipe(protocol, numbers, 10.0) is None  # a ties b at 4k and b's 32k perplexity is unmeasured
    numbers["b"]["ppl"] = 4.6
    assert select_recipe(protocol, numbers, 10.0) == "b"  # the tie goes to b's lower 32k perplexity (a: 5.0)
    del numbers["c"]["ppl_unseen"]
    assert select_recipe(protocol, numbers, 10.0) is None  # who qualifies is open while c's 2k perplexity is
    numbers["c"]["ppl_unseen"], numbers["c"]["passkey"][4096] = 10.0, 1.0
    del numbers["c"]["passkey"][32768]
    assert select_recipe(protocol, numbers, 10.0) == "c"  # the only qualified candidate, whatever its 32k passkey
    numbers["b"]["passkey"][4096] = 0.95
    assert select_recipe(protocol, numbers, 10.0) is None  # b qualifies too: c's unmeasured 32k passkey decides
    numbers["c"]["passkey"][32768] = 0.1
    assert select_recipe(protocol, numbers, 10.0) == "b"  # b's 0.9 against c's 0.1


# ------------------------------------------------------------------------------------------ the equivalence test


def _newcombe_by_hand(h1, n1, h2, n2, z):
    """Wilson (p + z^2/2n +- z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n) for each, then Newcombe's method 10."""
    def w(h, n):
        p = h / n
        c, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
        return p, max(0.0, (c - half) / (1 + z * z / n)), min(1.0, (c + half) / (1 + z * z / n))
    (p1, l1, u1), (p2, l2, u2) = w(h1, n1), w(h2, n2)
    return p1 - p2, p1 - p2 - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2), p1 - p2 + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2)


@pytest.mark.parametrize("counts, said", [((27, 30, 28, 30), "not shown equivalent"),  # too few trials: wide
                                          ((250, 274, 252, 274), "equivalent"),
                                          ((230, 274, 252, 274), "not shown equivalent"),  # 0.08 worse: past -0.10
                                          ((110, 117, 111, 117), "equivalent")])
def test_equivalence_is_the_90_percent_newcombe_interval_inside_the_margin(counts, said):
    d, low, high, verdict_ = equivalence(*counts, 0.10)
    assert Z90 == pytest.approx(1.6448536269514722)  # the normal's 95% quantile: two one-sided tests at 0.05
    assert (d, low, high) == pytest.approx(_newcombe_by_hand(*counts, 1.6448536269514722))
    assert verdict_ == said == ("equivalent" if -0.10 < low and high < 0.10 else "not shown equivalent")
    assert (round(low, 4), round(high, 4)) == {(27, 30, 28, 30): (-0.1664, 0.0970),
                                                (250, 274, 252, 274): (-0.0470, 0.0323),
                                                (230, 274, 252, 274): (-0.1263, -0.0347),
                                                (110, 117, 111, 117): (-0.0615, 0.0438)}[counts]


def test_equivalence_power_is_exact_and_agrees_with_a_brute_force_sum_and_a_simulation():
    def brute(p1, n1, p2, n2, m):  # every outcome, one at a time, through `equivalence` itself
        return sum(math.comb(n1, a) * p1 ** a * (1 - p1) ** (n1 - a) * math.comb(n2, b) * p2 ** b * (1 - p2) ** (n2 - b)
                   for a in range(n1 + 1) for b in range(n2 + 1) if equivalence(a, n1, b, n2, m)[3] == "equivalent")

    for args in ((0.9, 40, 0.9, 40, 0.15), (0.8, 25, 0.95, 30, 0.2), (0.5, 12, 0.5, 12, 0.3)):
        assert equivalence_power(*args) == pytest.approx(brute(*args), abs=1e-12)
    rng = np.random.default_rng(0)  # 20,000 simulated pairs of runs at 0.85 and 117 trials
    hits = rng.binomial(117, 0.85, size=(20000, 2))
    share = np.mean([equivalence(int(a), 117, int(b), 117, 0.10)[3] == "equivalent" for a, b in hits])
    assert share == pytest.approx(equivalence_power(0.85, 117, 0.85, 117, 0.10), abs=0.01)
    assert equivalence_power(0.9, 30, 0.9, 30, 0.0) == 0.0  # no interval fits inside an empty margin


def test_equivalence_trials_is_the_first_count_that_reaches_the_power():
    n = equivalence_trials(0.95, 0.10, 0.8)
    assert equivalence_power(0.95, n, 0.95, n, 0.10) >= 0.8
    assert all(equivalence_power(0.95, k, 0.95, k, 0.10) < 0.8 for k in range(2, n))
    with pytest.raises(ValueError, match="no n"):
        equivalence_trials(0.5, 0.01, 0.99, limit=50)


def test_the_amendment_of_addendum_a_states_its_power_truly_and_corrects_the_power_line():
    """Amendment 1's counts are the fewest with power >= sqrt(0.8) at each length (so >= 0.8 for the claim), every
    power it states recomputes, and its corrected `power_checked` line says what the addendum's comment says (Full
    at 0.95, PoSE at 0.75, PoSE found worse), where the registered line had the roles swapped."""
    import yaml

    protocol = load_protocol(PROTOCOLS / "real_model_full_length.yaml")
    assert protocol["amendments"] == ["real_model-full-length-v1-amendment-1"]
    assert protocol["as_registered"]["passkey_trials"] == {4096: 30, 8192: 30, 16384: 30, 32768: 24}
    assert protocol["passkey"]["trials"] == {4096: 30, 8192: 30, 16384: 117, 32768: 274}
    stated, target = protocol["power"], protocol["power"]["target"]
    for length, n in protocol["passkey"]["trials"].items():
        if length in protocol["equivalence"]["lengths"]:
            assert n == equivalence_trials(stated["assumed"][length], protocol["equivalence"]["margin"],
                                           math.sqrt(target))
    found = checked_equivalence_power(protocol)
    assert {k: round(v, 3) for k, v in found["lengths"].items()} == stated["lengths"]
    assert round(found["claim"], 3) == stated["claim"] >= target
    for length, n in ((16384, 117), (32768, 274)):
        p = stated["assumed"][length]
        assert round(power(p, n, p, n), 3) == stated["registered_test"]["false_worse"][length]
        assert round(power(p, n, p - 0.10, n), 3) == stated["registered_test"]["gap_found"][length]
    registered = protocol["as_registered"]["power_checked"]
    assert (registered["control"], registered["pose"]) == (0.75, 0.95)  # the line as registered: roles swapped
    assert power(0.75, 24, 0.95, 24) < 0.001  # read as written (PoSE 0.95 better than Full 0.75 is its 0.50) ...
    corrected = protocol["power_checked"]
    assert (corrected["control"], corrected["pose"], corrected["direction"]) == (0.95, 0.75, "worse")
    assert checked_power(protocol) == pytest.approx(corrected["power"], abs=0.005)  # ... as its comment says
    text = (PROTOCOLS / "real_model_full_length.yaml").read_text()
    assert "Full retrieves 0.95 and PoSE p: 24 trials (32k): p 0.85 -> 0.14, 0.75 -> 0.50" in text
    raw = yaml.safe_load((PROTOCOLS / "real_model_full_length.amendment-1.yaml").read_text())
    assert raw["registered"] == "2026-11-29" and raw["amends"] == protocol["name"]
    with pytest.raises(ValueError, match="amends"):
        amend(load_protocol(PROTOCOLS / "real_model_8x.yaml"), raw)


def test_equivalence_tests_and_claim_b_on_hand_made_counts():
    from experiments.evidence_full_length import claim_b

    protocol = load_protocol(PROTOCOLS / "real_model_full_length.yaml")
    runs = {"pose-yarn-joined": {"passkey": {"16384": 110 / 117, "32768": 250 / 274}, "ppl": {"32768": 6.2},
                                 "passkey_trials": {"16384": 117, "32768": 274}},
            "full-yarn": {"passkey": {"16384": 111 / 117, "32768": 252 / 274}, "ppl": {"32768": 6.0},
                          "passkey_trials": {"16384": 117, "32768": 274}}}
    tests = {(t["measure"], t["length"]): t for t in equivalence_tests(protocol, runs)}
    assert set(tests) == {("passkey", 16384), ("passkey", 32768), ("perplexity", 32768)}
    t = tests[("passkey", 32768)]
    assert t["ci90"] == pytest.approx(list(_newcombe_by_hand(250, 274, 252, 274, Z90)[1:]))
    assert t["verdict"] == "equivalent" and t["counts"] == {"pose-yarn-joined": [250, 274], "full-yarn": [252, 274]}
    assert tests[("perplexity", 32768)]["ratio"] == pytest.approx(6.2 / 6.0)  # 1.033: inside 1 +- 0.05
    assert claim_b(protocol, list(tests.values()))["held"] is True
    runs["pose-yarn-joined"]["ppl"]["32768"] = 6.4  # 1.067: outside
    assert claim_b(protocol, equivalence_tests(protocol, runs))["held"] is False
    runs["pose-yarn-joined"]["ppl"]["32768"] = 5.6  # 0.933: better by more than the margin is not "equivalent"
    assert claim_b(protocol, equivalence_tests(protocol, runs))["held"] is False
    del runs["full-yarn"]["passkey"]["16384"]
    assert claim_b(protocol, equivalence_tests(protocol, runs))["held"] is None  # not decided while one is missing
    assert equivalence_tests(load_protocol(PROTOCOLS / "real_model.yaml"), runs) == []  # no amendment there


def test_the_evidence_page_quotes_the_amendment_as_registered():
    """docs/evidence.md's paragraph on amendment 1 says what the amendment's record says."""
    protocol = load_protocol(PROTOCOLS / "real_model_full_length.yaml")
    text = " ".join((PROTOCOLS.parents[1] / "docs" / "evidence.md").read_text().split())
    eq, pw, trials = protocol["equivalence"], protocol["power"], protocol["passkey"]["trials"]
    registered = yaml.safe_load((PROTOCOLS / "real_model_full_length.amendment-1.yaml").read_text())["registered"]
    for phrase in (f"registered {registered}, before any of the addendum's fine-tunings or trials",
                   f"inside +-{eq['margin']:.2f}", f"inside 1 +- {eq['perplexity']['margin']:.2f}",
                   f"{trials[16384]} at 16k and {trials[32768]} at 32k for both runs",
                   f"both runs retrieve {pw['assumed'][16384]:.2f} and {pw['assumed'][32768]:.2f}",
                   f"the claim's power is {pw['claim']:.3f}",
                   f"with probability {protocol['power_checked']['power']:.2f}"):
        assert phrase in text, phrase
