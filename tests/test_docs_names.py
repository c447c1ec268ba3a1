"""Every `pose_mlx.<name>` that the docs, the READMEs and the code's comments and docstrings mention exists:
dotted names import (the longest module prefix) and resolve attribute by attribute; every
`python -m pose_mlx.<module>` is a runnable module and every `python -m benchmarks.<script>` (`experiments.`) a
file in benchmarks/ (experiments/). A record under benchmarks/results/ keeps the command of the day it was written:
a script it names may since have moved to experiments/."""

import importlib
import importlib.util
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NAME = re.compile(r"(?<![\w/])pose_mlx(?:\.[A-Za-z_]\w*)+")
COMMAND = re.compile(r"python -m (pose_mlx(?:\.\w+)*)")
SCRIPT = re.compile(r"python -m (benchmarks|experiments)\.(\w+)")
SUFFIX = re.compile(r"\.(py|json|md)$")  # a file name, not a dotted name


def _docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "benchmarks").glob("**/*.md")),
            *sorted((ROOT / "experiments").glob("**/*.md"))]


def _sources() -> list[Path]:
    own = Path(__file__).resolve()  # its stale examples are on purpose
    return sorted(p for folder in ("pose_mlx", "tools", "benchmarks", "experiments", "tests") for p in (ROOT / folder).glob("**/*.py")
                  if p.resolve() != own)


def _prose(path: Path) -> str:
    """A Markdown file whole; of a Python file its comments and string literals (docstrings included)."""
    text = path.read_text()
    if path.suffix != ".py":
        return text
    kinds = {tokenize.COMMENT, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
    return "\n".join(t.string for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type in kinds)


def _mentions() -> dict[str, set[str]]:
    """name -> the files that mention it."""
    found: dict[str, set[str]] = {}
    for path in _docs() + _sources():
        for match in NAME.finditer(_prose(path)):
            name = SUFFIX.sub("", match.group(0))  # pose_mlx.json: a file, no name
            if "." in name:
                found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def resolve(name: str) -> str | None:
    """None if `name` resolves (or ends in an upper-case placeholder that does not: `pose_mlx.COMMAND`,
    `pose_mlx.eval.NAME`), else why not."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            if importlib.util.find_spec(module) is None:
                continue
        except ModuleNotFoundError:  # a parent is a module, not a package
            continue
        obj = importlib.import_module(module)
        for j, part in enumerate(parts[i:], i):
            if not hasattr(obj, part):
                if j == len(parts) - 1 and part.isalpha() and part.isupper():
                    return None
                return f"{module} has no {'.'.join(parts[i:])}"
            obj = getattr(obj, part)
        return None
    return "no such module"


def test_the_resolver_tells_stale_names():
    assert resolve("pose_mlx.training.loop.make_update") is None and resolve("pose_mlx.extend") is None
    assert resolve("pose_mlx.train.make_update") == "pose_mlx has no train.make_update"
    assert resolve("pose_mlx.toy.build_model") == "pose_mlx.toy has no build_model"
    assert resolve("pose_mlx.COMMAND") is None and resolve("pose_mlx.NAME.main") == "pose_mlx has no NAME.main"


def test_every_mentioned_name_exists():
    stale = {name: sorted(files) for name, files in _mentions().items() if resolve(name) is not None}
    assert not stale, "\n".join(f"{name} ({resolve(name)}) in {', '.join(files)}" for name, files in stale.items())


@pytest.mark.parametrize("path", _docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_documented_command_is_a_module(path):
    for module in set(COMMAND.findall(path.read_text())) - {"pose_mlx"}:
        if module.split(".")[-1].isupper():
            continue
        spec = importlib.util.find_spec(module)
        assert spec is not None, f"{path.name}: python -m {module}: no such module"
        if spec.submodule_search_locations is not None:  # a package runs its __main__
            assert importlib.util.find_spec(f"{module}.__main__") is not None, f"{path.name}: {module} has no __main__"


@pytest.mark.parametrize("path", _docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_documented_script_exists(path):
    record = (ROOT / "benchmarks" / "results") in path.parents
    for package, script in set(SCRIPT.findall(path.read_text())):
        homes = ("benchmarks", "experiments") if record else (package,)
        assert any((ROOT / home / f"{script}.py").is_file() for home in homes), \
            f"{path.name}: python -m {package}.{script}"
