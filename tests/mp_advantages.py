"""Run under ``accelerate launch`` by tests/test_multiprocess.py: one rollout + advantages, and
write what this process computed (gathered over processes) to OUT."""
import sys

import torch

from flowgrpo.config import load_config
from flowgrpo.trainer import Trainer
from tests.helpers import report_and_close

torch.set_num_threads(1)
config_path, out_path = sys.argv[1], sys.argv[2]
trainer = Trainer(load_config(config_path))
batch, rewards, _ = trainer.rollout_and_score(0)
advantages, metrics = trainer.compute_advantages(batch, rewards)
acc = trainer.accelerator
record = {
    "sample_ids": acc.gather(batch.sample_ids).tolist(),
    "group_ids": acc.gather(batch.group_ids).tolist(),
    "rewards": acc.gather(rewards["total"]).tolist(),
    "advantages": acc.gather(advantages).tolist(),
    "num_processes": acc.num_processes,
}
report_and_close(acc, out_path, record)
