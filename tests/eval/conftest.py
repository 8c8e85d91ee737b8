"""Shared fixtures: one tokenised corpus per session and one small trained checkpoint."""

import pytest

#: Iterations of the session checkpoint: enough for omission to change the loss visibly.
CHECKPOINT_ITERATIONS = 15


@pytest.fixture(scope="session")
def data_cfg():
    from node.train.data import DataConfig

    return DataConfig(microbatch_size=4)


@pytest.fixture(scope="session")
def splits(_cache_dir, data_cfg):
    from node.train.data import load_splits

    return load_splits(data_cfg)


def skip_schedule():
    from node.launch.schedules import build_schedule

    # 2 data nodes, replicas 2,2,1,1,1, paths of 4/6 stages, some reordered
    return build_schedule(6, data_nodes=2, replicas=[2, 2, 1, 1, 1], path_length=4, microbatches=4, memory=2,
                          reorder=True)


@pytest.fixture(scope="session")
def trained(tmp_path_factory, splits, data_cfg):
    """(trainer, checkpoint run folder) after a short skip-path run."""
    from node.train.model import model_config
    from node.eval.path_training import PathTrainer
    from node.train.runtime import OptimConfig

    trainer = PathTrainer(model_config("tiny"), OptimConfig(lr=3e-3), data_cfg, splits, skip_schedule(), seed=0)
    for _ in range(CHECKPOINT_ITERATIONS):
        trainer.train_iteration()
    root = tmp_path_factory.mktemp("ckpt")
    trainer.save_checkpoint(root, "skiprun")
    return trainer, root / "skiprun"
