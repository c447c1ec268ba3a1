"""benchmarks/bench_quickstart.py runs the README's quick-start block as a user would: line by line in bash, each
line starting from the environment the lines before it left, in a folder shaped like the repository's root."""

from pathlib import Path

import pytest

from benchmarks import bench_quickstart as quickstart


def test_the_block_is_the_code_between_the_markers():
    text = (f"intro\n{quickstart.BEGIN} (timed) -->\n```\n. .venv/bin/activate\n\nX=1\necho $X\n```\n"
            f"{quickstart.END}\nafter\n```\nnot this\n```\n")
    assert quickstart.readme_block(text) == [". .venv/bin/activate", "X=1", "echo $X"]
    with pytest.raises(SystemExit, match="one ``` code block"):
        quickstart.readme_block(f"{quickstart.BEGIN} -->\nno block\n{quickstart.END}")


def test_each_line_runs_in_the_environment_the_lines_before_it_left(tmp_path: Path):
    """An assignment (also one from a command's output) reaches the later lines, a redirect writes its file in the
    folder, the lines that are not pose_mlx commands add up as the setup, and a failing line stops the run."""
    lines = ['NAME="$(printf %s world)"', "COUNT=3", 'printf "%s %s" "$NAME" "$COUNT" > said.txt']
    record = quickstart.run_block(lines, tmp_path)
    assert (tmp_path / "said.txt").read_text() == "world 3"
    assert record["steps"] == {} and set(record["setup"]) == {"wall_s", "cpu_s"}
    with pytest.raises(SystemExit, match="'false' failed"):
        quickstart.run_block(["false"], tmp_path)
