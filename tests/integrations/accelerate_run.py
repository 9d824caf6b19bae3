"""accelerate's API in a plain loop, under torchrun or alone: ``prepare(accelerator, ds)``
(or, with ``--plain-prepare``, accelerate's own ``accelerator.prepare(DataLoader(...))``, which
must fail with tabloader's rank timeout), gradient accumulation, ``save_state`` after step
``--stop-after`` and ``load_state`` in the run that resumes. See ``_common.py``."""

from __future__ import annotations

import gc

# Python's collector runs through the frameworks' imports (a third of transformers' import
# time, 2.1 of 7.1 CPU-s; Lightning's 1.3 of 6.5): off until they are done (the tests'
# subject is what the script does after); a user's script needs none of this.
gc.disable()

from pathlib import Path

import torch
from _common import arguments, crash, features, model, record
from accelerate import Accelerator
from torch.utils.data import DataLoader

from tabloader.integrations.accelerate import prepare
from tabloader.torch import JobDataset

gc.enable()
args = arguments()
accelerator = Accelerator(cpu=True, gradient_accumulation_steps=4)  # cpu: join torchrun's
net = model()
optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
net, optimizer = accelerator.prepare(net, optimizer)
data = JobDataset(args.job, catalog=args.catalog, epochs=args.epochs)
if args.plain_prepare:  # what users try first
    loader = accelerator.prepare(DataLoader(data, batch_size=None))
else:
    loader = prepare(accelerator, data)  # docs/frameworks.md's accelerate recipe
start = 0
if args.resume:
    accelerator.load_state(args.resume)
    start = int(Path(args.resume, "epoch").read_text())
step = 0
rank = accelerator.process_index
for epoch in range(start, args.epochs):
    for batch in loader:
        assert batch["image"].device.type == accelerator.device.type
        with accelerator.accumulate(net):
            loss = torch.nn.functional.cross_entropy(net(features(batch["image"])), batch["label"])
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            synced = accelerator.sync_gradients  # every 4th batch, and an epoch's last
        record(args, "train", rank, epoch, batch["_id"], synced=synced)
        step += 1
        if step == args.stop_after:
            accelerator.save_state(args.ckpt)
            if accelerator.is_main_process:
                Path(args.ckpt, "epoch").write_text(str(epoch))
            accelerator.wait_for_everyone()
            crash()
accelerator.end_training()  # as a training script ends (destroys the process group)
