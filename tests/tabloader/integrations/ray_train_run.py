"""Ray Train: ``JobDataset`` inside a ``TorchTrainer``'s train function, 2 workers on a local
Ray; each worker finds its rank from what Ray Train sets (``RANK``/``WORLD_SIZE`` and the
process group), no glue. See ``_common.py`` for the arguments and what is recorded."""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray
from _common import arguments
from ray.train import ScalingConfig
from ray.train.torch import TorchTrainer

args = arguments()


def train(config: dict[str, Any]) -> None:  # the README's Ray Train recipe
    import torch
    from _common import features, model, record

    from tabloader.torch import JobDataset

    data = JobDataset(config["job"], catalog=config["catalog"], epochs=config["epochs"])
    net = ray.train.torch.prepare_model(model())
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    rank = ray.train.get_context().get_world_rank()
    for epoch in range(config["epochs"]):
        for batch in data:
            loss = torch.nn.functional.cross_entropy(net(features(batch["image"])), batch["label"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            record(config["args"], "train", rank, epoch, batch["_id"])
    data.close()


ray.init(address="local", num_cpus=4, include_dashboard=False)
config = {"job": args.job, "catalog": args.catalog, "epochs": args.epochs, "args": args}
TorchTrainer(
    train, train_loop_config=config, scaling_config=ScalingConfig(num_workers=2, use_gpu=False)
).fit()
ray.shutdown()
