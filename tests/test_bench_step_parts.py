"""benchmarks.bench_cpu_step_parts: its parts are the model's, and its update trains the adapters."""

import mlx.core as mx
import mlx.nn as nn
import pytest

from benchmarks import bench_cpu_step_parts as parts
from pose_mlx import extend
from pose_mlx.training.lora import LoraSpec, add_lora


def test_the_products_have_the_shapes_of_each_blocks_projections(tiny_llama):
    block = tiny_llama.layers[0]
    linears = [block.self_attn.q_proj, block.self_attn.k_proj, block.self_attn.v_proj, block.self_attn.o_proj,
               block.mlp.gate_proj, block.mlp.up_proj, block.mlp.down_proj]
    assert parts.product_shapes(tiny_llama.args) == [tuple(m.weight.shape) for m in linears]


@pytest.mark.parametrize("kernels", ["auto", "mlx"])
def test_the_timed_update_trains_the_adapters_and_only_them(tiny_llama, kernels):
    extend(tiny_llama, "yarn", 64, 256)
    add_lora(tiny_llama, LoraSpec(4, 20.0, -1), seed=0)
    frozen = tiny_llama.layers[0].self_attn.q_proj.linear.weight
    before = {k: mx.array(v) for k, v in nn.utils.tree_flatten(tiny_llama.trainable_parameters())}
    frozen_before = mx.array(frozen)
    ids = mx.random.randint(0, tiny_llama.args.vocab_size, (1, 17), key=mx.random.key(3))
    parts.update_case(tiny_llama, (ids[:, :-1], ids[:, 1:], mx.ones((1, 16))), kernels)()
    after = dict(nn.utils.tree_flatten(tiny_llama.trainable_parameters()))
    assert all(k.endswith(("lora_a", "lora_b")) for k in after)
    assert any(not mx.array_equal(before[k], after[k]) for k in after if k.endswith("lora_b"))
    assert mx.array_equal(tiny_llama.layers[0].self_attn.q_proj.linear.weight, frozen_before)


def test_each_part_runs_on_the_models_shapes(tiny_llama):
    cases = parts.parts_cases(tiny_llama, 32)
    assert set(cases) == {"products", "head products", "attention", "loss"}
    for run in cases.values():
        run()


def test_bad_arguments_are_one_argparse_line(capsys):
    with pytest.raises(SystemExit) as stopped:
        parts.main(["--reps", "0"])
    assert stopped.value.code == 2
    assert "--reps" in capsys.readouterr().err
