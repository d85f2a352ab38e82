"""Run under ``accelerate launch`` by tests/test_curriculum.py: two iterations with the variance
curriculum on; every process writes its curriculum state and draws to OUT.<rank>.json."""
import json
import os
import sys

import torch

from flowgrpo.config import load_config
from flowgrpo.trainer import Trainer

torch.set_num_threads(1)
config_path, out_path = sys.argv[1], sys.argv[2]
trainer = Trainer(load_config(config_path))
record = {"states": [], "draws": [], "local_rows": []}
for iteration in range(2):
    metrics = trainer.run_iteration(iteration)
    record["draws"].append(trainer.group_prompts(iteration))
    record["states"].append(trainer.curriculum.state_dict())
    record["local_rows"].append(len(trainer.local_batch(iteration)[0]))
record["num_processes"] = trainer.accelerator.num_processes
with open(f"{out_path}.{trainer.accelerator.process_index}.json", "w") as f:
    json.dump(record, f)
trainer.accelerator.wait_for_everyone()
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
os._exit(0)   # see tests.helpers.report_and_close: no C++ teardown abort after the work is done
