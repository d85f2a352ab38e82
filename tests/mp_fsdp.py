"""Run under ``accelerate launch`` by tests/test_fsdp.py: train a config (optionally resuming a
checkpoint) and report how the engine holds the trainable weights.

    mp_fsdp.py CONFIG OUT [RESUME]

RESUME: a checkpoint folder to continue from (absent: a fresh run). OUT gets, besides the
iteration metrics, each process's count of the elements it holds locally (trainable ones, and
all of the transformer's) next to the model's full counts, which under FSDP2 shows that the
parameters really are split."""
import sys

import torch

from flowgrpo.config import load_config
from flowgrpo.engines import local_shard
from flowgrpo.trainer import Trainer
from tests.helpers import history_record, report_and_close

torch.set_num_threads(1)
config_path, out_path = sys.argv[1], sys.argv[2]
resume = sys.argv[3] if len(sys.argv) > 3 else None
trainer = Trainer(load_config(config_path))
acc = trainer.accelerator
history = trainer.train(resume=resume)
trainable = trainer.trainable
everything = list(trainer.module.parameters())   # frozen base weights too (LoRA)


def per_process(parameters) -> list[int]:
    """Each process's count of the elements of ``parameters`` it holds."""
    local = torch.tensor([sum(local_shard(p).numel() for p in parameters)], device=acc.device)
    return acc.gather(local).tolist() if acc.num_processes > 1 else local.tolist()


record = {
    "num_processes": acc.num_processes,
    "engine": trainer.engine,
    "sharded": trainer.sharded,
    "wrapper": type(trainer.engine_module).__name__,
    "dtensor_parameters": sum(type(p).__name__ == "DTensor" for p in trainable.values()),
    "trainable_parameters": len(trainable),
    # DTensor.numel() is the whole tensor's, the local shard's is this process's part
    "full_elements": sum(p.numel() for p in trainable.values()),
    "local_elements": per_process(trainable.values()),
    "all_full_elements": sum(p.numel() for p in everything),
    "all_local_elements": per_process(everything),
    "dtypes": sorted({str(p.dtype) for p in everything}),
    "start_iteration": trainer.start_iteration,
    **history_record(history),
}
report_and_close(acc, out_path, record)
