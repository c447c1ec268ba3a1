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
