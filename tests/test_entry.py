"""`python -m pose_mlx` and the console script that pyproject.toml declares: the list of commands, the dispatch to
`python -m pose_mlx.COMMAND`, and no MLX import to list them."""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pose_mlx import __main__ as entry

ROOT = Path(__file__).resolve().parents[1]


def run(*argv):
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    return proc.returncode, proc.stdout, proc.stderr


def command_modules() -> set[str]:
    """Every module of the package that runs as `python -m`: it has an `if __name__ == "__main__":` block
    (found by parsing the sources, independently of the list)."""
    found = set()
    for path in (ROOT / "pose_mlx").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'":
                found.add(".".join(path.relative_to(ROOT).with_suffix("").parts))
    return found - {"pose_mlx.__main__"}


def test_lists_every_command_in_one_line_each_without_mlx():
    code, out, err = run("-c", "import sys; from pose_mlx.__main__ import main; main([]); "
                               "print(sorted(m for m in sys.modules if m == 'mlx' or m.startswith('mlx.')))")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[-1] == "[]"  # listing the commands imported no MLX module
    listed = [line.split()[0] for line in lines if line.startswith("  ")]
    assert listed == list(entry.COMMANDS)
    assert {module for module, _text in entry.COMMANDS.values()} == command_modules()


def test_module_entry_point(tmp_path):
    code, out, err = run("-m", "pose_mlx")
    assert code == 0 and err == "" and "usage: python -m pose_mlx COMMAND" in out
    code, out, err = run("-m", "pose_mlx", "frobnicate")
    assert code == 2 and out == ""
    assert err.strip() == f"pose_mlx: error: unknown command 'frobnicate'; the commands are: {', '.join(entry.COMMANDS)}"


def test_dispatch_runs_the_command_with_its_flags(tmp_path, capsys):
    """`pose_mlx plan ...` is `python -m pose_mlx.plan ...`: the same output and exit code, bad input included."""
    from pose_mlx import plan

    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, '
                                          '"intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 100, '
                                          '"max_position_embeddings": 128, "tie_word_embeddings": true, '
                                          '"torch_dtype": "float32"}')
    argv = ["--model", str(tmp_path), "--target", "4x", "--json", "--max-memory", "1GB"]
    assert entry.main(["plan", *argv]) == 0
    via_entry = capsys.readouterr()
    assert plan.main(argv) == 0
    assert capsys.readouterr() == via_entry
    assert entry.main(["plan", "--model", str(tmp_path), "--target", "banana"]) == 2
    assert "pose_mlx.plan: error: " in capsys.readouterr().err


def test_console_scripts_declared_in_pyproject_resolve():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"pose-mlx": "pose_mlx.__main__:main"}
    for name, target in scripts.items():
        module, _, attr = target.partition(":")
        assert callable(getattr(importlib.import_module(module), attr)), name


@pytest.mark.parametrize("name", list(entry.COMMANDS))
def test_every_listed_command_has_a_main(name):
    module = importlib.import_module(entry.COMMANDS[name][0])
    assert callable(module.main)


@pytest.mark.parametrize("name", list(entry.COMMANDS))
def test_no_help_text_ends_a_paragraph_by_naming_its_own_command(name, capsys):
    """`--help` of passkey read "Passkey retrieval ... at several context lengths: `python -m
    pose_mlx.passkey`." under a usage line that already says the command: no paragraph of a command's help ends
    with its own `python -m` line."""
    module = entry.COMMANDS[name][0].removesuffix(".__main__")
    with pytest.raises(SystemExit) as done:
        importlib.import_module(entry.COMMANDS[name][0]).main(["--help"])
    assert done.value.code == 0
    paragraphs = [" ".join(p.split()) for p in capsys.readouterr().out.split("\n\n")]
    own = re.compile(rf"python -m {re.escape(module)}\b[^`]*`?\.?$")  # also "...: `python -m X -n N ...`."
    assert paragraphs[1:] and not [p for p in paragraphs[1:] if own.search(p)]  # [0]: the usage line


def run_into_closed_pipe(*argv):
    """(exit code, stderr) of `python argv` whose stdout is a pipe that its reader has already closed: every
    write fails, as when `| head -1` has read its line and exited (deterministic: no race with the reader)."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([sys.executable, *argv], stdout=write, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                              timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    finally:
        os.close(write)
    return proc.returncode, proc.stderr


def test_output_into_a_closed_pipe_ends_quietly_with_141(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, '
                                          '"intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 100, '
                                          '"max_position_embeddings": 128, "torch_dtype": "float32"}')
    plan = ["--model", str(tmp_path), "--target", "4x", "--max-memory", "1GB"]
    for argv in (["-m", "pose_mlx"], ["-m", "pose_mlx.plan", *plan], ["-m", "pose_mlx", "plan", *plan]):
        assert run_into_closed_pipe(*argv) == (141, ""), argv


def test_a_broken_pipe_that_is_not_stdout_keeps_its_traceback(capsys):
    from pose_mlx.errors import command

    @command("a-command")
    def broken(_argv):
        raise BrokenPipeError(32, "Broken pipe")  # e.g. a child's stdin; stdout (captured here) is fine

    with pytest.raises(BrokenPipeError):
        broken([])


def test_version_has_one_source():
    """`pose-mlx --version` and `python -m pose_mlx --version` print pose_mlx.__version__, which is also the
    version pyproject.toml gives the package (read from it, not written twice) and the installed metadata's."""
    import importlib.metadata

    import pose_mlx

    for argv in (["-m", "pose_mlx", "--version"], ["-m", "pose_mlx", "-V"]):
        assert run(*argv) == (0, f"pose-mlx {pose_mlx.__version__}\n", "")
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "pose_mlx.__version__"}
    assert importlib.metadata.version("pose-mlx") == pose_mlx.__version__


def test_license_file_is_the_mit_license_pyproject_declares():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "MIT" and project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License\n\nCopyright (c) 2026 the pose-mlx authors\n")
    assert "THE SOFTWARE IS PROVIDED \"AS IS\", WITHOUT WARRANTY OF ANY KIND" in text
