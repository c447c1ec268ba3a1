"""pose_mlx.settings: how flags, YAML and run.json become a run's validated settings, and the messages of bad ones."""

import pytest

from pose_mlx.errors import UserError
from pose_mlx.settings import parse_invocation


def _settings(*argv):
    return parse_invocation(["--model", "m", *argv]).settings


def _refusal(*argv) -> str:
    with pytest.raises(UserError) as error:
        _settings(*argv)
    return str(error.value)


@pytest.mark.parametrize("flag, given, expected", [
    ("--schedule", "YaRN", "yarn"), ("--schedule", "LINEAR", "linear"), ("--schedule", "LongRoPE", "longrope"),
    ("--sampler", "PoSE", "pose"), ("--sampler", "Pose-Middle", "pose-middle"), ("--content", "Zero", "zero")])
def test_names_are_read_in_any_case(flag, given, expected):
    """The README spells it `--schedule YaRN`; names are case-insensitive, from a flag and from YAML."""
    assert getattr(_settings(flag, given), flag.lstrip("-")) == expected


def test_names_in_yaml_are_read_in_any_case(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("schedule: YaRN\nsampler: RandPos\n")
    s = _settings("--config", str(config))
    assert (s.schedule, s.sampler) == ("yarn", "randpos")


@pytest.mark.parametrize("flag, given, close", [("--schedule", "yarm", "yarn"), ("--schedule", "Dynamc", "dynamic"),
                                                ("--sampler", "pse", "pose"), ("--sampler", "RANDPOSE", "randpos"),
                                                ("--sampler", "pose_ref", "pose-ref")])
def test_an_unknown_name_suggests_the_closest_in_one_line(flag, given, close):
    message = _refusal(flag, given)
    assert message.startswith(f"{flag} {given!r} is not one of ") and message.endswith(f"; did you mean '{close}'?")
    assert "\n" not in message


def test_a_name_nothing_is_close_to_lists_the_choices():
    message = _refusal("--sampler", "qqqqqq")
    assert message == "--sampler 'qqqqqq' is not one of pose, pose-ref, pose-middle, randpos, full, plain, none"


@pytest.mark.parametrize("given", ["8", "8.5", " 16 "])
def test_max_memory_without_a_unit_is_refused_with_the_spelling_to_use(given, tmp_path):
    """`--max-memory 8` was read as 8 bytes (and refused every run as too large); now it asks for the unit."""
    number = given.strip()
    expected = f"--max-memory {number} has no unit: write e.g. {number}G (units K, M, G, T are binary; B for bytes)"
    assert _refusal("--max-memory", given) == expected
    config = tmp_path / "run.yaml"
    config.write_text(f"max_memory: {number}\n")  # a YAML number, as a user would write it
    assert _refusal("--config", str(config)) == expected


@pytest.mark.parametrize("given", ["8G", "8GB", "8GiB", "512M", "1.5T", "4096B"])
def test_max_memory_with_a_unit_is_taken(given):
    assert _settings("--max-memory", given).max_memory == given


def _results_numbers() -> set:
    """How the project's reports quote the real-model results: each run's perplexities with two decimals and its
    passkey counts as found/trials (benchmarks/results/real_model/results.json)."""
    import json
    from pathlib import Path

    record = json.loads((Path(__file__).parents[1] / "benchmarks/results/real_model/results.json").read_text())
    quoted = set()
    for run in record["runs"].values():
        for stage in (run, run.get("exploratory") or {}):
            quoted |= {f"{v:.2f}" for v in (stage.get("ppl") or {}).values()}
            for length, accuracy in (stage.get("passkey") or {}).items():
                trials = stage["passkey_trials"][length]
                quoted.add(f"{round(accuracy * trials)}/{trials}")
    return quoted


@pytest.mark.parametrize("command, most", [("finetune", 134), ("plan", 70)])
def test_help_says_what_each_flag_does_and_quotes_no_results(command, most, capsys):
    """--help was 184 lines with screening results in --sampler, --short-share and --schedule-param (and plan
    repeated them): each flag's help is what it does and its default; the measurements live in docs/."""
    import re
    from importlib import import_module

    with pytest.raises(SystemExit) as exit:
        import_module(f"pose_mlx.{command}").main(["--help"])
    assert exit.value.code == 0
    text = capsys.readouterr().out
    assert len(text.splitlines()) <= most
    quoted = _results_numbers()
    assert {"5.55", "17/24", "29/30", "6.31"} <= quoted  # the numbers the help quoted before
    for line in text.splitlines():
        numbers = set(re.findall(r"\d+/\d+|\d+\.\d\d", line))
        assert not numbers & quoted, line
        assert not re.search(r"screening|SmolLM2|\d+ -> \d+|passkey|perplexity", line), line
    assert "docs/" in text


def test_usage_shows_the_required_flags_as_required(capsys):
    from pose_mlx import finetune, plan

    with pytest.raises(SystemExit):
        finetune.main(["--help"])
    usage = capsys.readouterr().out.split("\n\n")[0]
    assert usage.startswith("usage: python -m pose_mlx.finetune --model MODEL --target LENGTH --data PATH [options]")
    assert "--config FILE" in usage and "--resume --output DIR" in usage
    with pytest.raises(SystemExit):
        plan.main(["--help"])
    assert capsys.readouterr().out.startswith("usage: python -m pose_mlx.plan --model MODEL [--target LENGTH]")


def test_the_default_schedule_is_yarn_and_linear_stays_available(tmp_path):
    """On the project's real model PoSE + PI was the worst trained recipe (benchmarks/results/real_model): the
    default is YaRN; PI, the PoSE paper's choice, is still one flag away (and one YAML key)."""
    assert _settings().schedule == "yarn"
    assert _settings("--schedule", "linear").schedule == "linear"
    config = tmp_path / "run.yaml"
    config.write_text("schedule: null\n")  # null: the default
    assert _settings("--config", str(config)).schedule == "yarn"


def test_a_run_json_without_a_schedule_resumes_with_the_one_it_was_trained_with(tmp_path):
    """A run folder whose run.json names no schedule was started when linear was the default: --resume continues
    it with linear, not with today's default; one that names its schedule keeps it."""
    import json

    from pose_mlx.settings import RunSettings, load_run_file

    partial = tmp_path / "out.partial"
    partial.mkdir()
    saved = {k: v for k, v in RunSettings(model="m", target="4x", data="d").to_json().items() if k != "schedule"}
    (partial / "run.json").write_text(json.dumps({"settings": saved, "world_size": 1}))
    assert load_run_file(partial / "run.json").schedule == "linear"
    resumed = parse_invocation(["--resume", "--output", str(tmp_path / "out")]).settings
    assert (resumed.schedule, resumed.model, resumed.target) == ("linear", "m", "4x")
    (partial / "run.json").write_text(json.dumps({"settings": {**saved, "schedule": "ntk"}, "world_size": 1}))
    assert parse_invocation(["--resume", "--output", str(tmp_path / "out")]).settings.schedule == "ntk"


@pytest.mark.parametrize("text, where, problem", [
    ("steps: 3\nlr: [1e-3\nwindow: 16\n", "3:7", "expected ',' or ']', but got ':'"),
    ("steps: 3\n  window: 16\n", "2:9", "mapping values are not allowed here"),
    ("model: m\n\tsteps: 3\n", "2:1", "found character '\\t' that cannot start any token"),
])
def test_bad_yaml_names_the_file_line_and_column(text, where, problem, tmp_path):
    """A malformed --config said only `cannot read it (ScannerError)`: now file:line:column and the parser's own
    problem, in one line."""
    config = tmp_path / "run.yaml"
    config.write_text(text)
    assert _refusal("--config", str(config)) == f"--config {config}:{where}: not valid YAML: {problem}"
