"""experiments/sim_cell_cost's bad input: one line from argparse, exit code 2, before any work starts."""

import pytest

from experiments import sim_cell_cost


@pytest.mark.parametrize("argv, said", [(["--cells", "pose-yarn"], "is not METHOD-Fx"),
                                        (["--cells", "pose-yarn-8x,8x"], "8x is not METHOD-Fx"),
                                        (["--steps", "1"], "--steps: at least 2")])
def test_bad_cells_and_steps_exit_2_with_one_line(argv, said, capsys):
    with pytest.raises(SystemExit) as stop:
        sim_cell_cost.main(argv)
    assert stop.value.code == 2
    assert said in capsys.readouterr().err.strip().splitlines()[-1]
