"""benchmarks.bench_cpu_train: runs added after results were seen stay apart from the registered rounds."""

from benchmarks import bench_cpu_train


def test_a_later_stage_is_never_pooled_with_the_registered_runs():
    runs = [{"config": "pose-1k", "round": 0, "tool": "pose_mlx", "seconds": [6.0]},
            {"config": "pose-1k", "round": 3, "tool": "pose_mlx", "seconds": [5.0], "stage": "later-1k"},
            {"config": "pose-2k", "round": 0, "tool": "pose_mlx", "seconds": [16.0]},
            {"config": "pose-1k", "round": 6, "tool": "pose_mlx", "seconds": [4.0], "stage": "another"}]
    registered, later = bench_cpu_train.by_stage(runs)
    assert registered == [runs[0], runs[2]]
    assert later == {"another": [runs[3]], "later-1k": [runs[1]]}
