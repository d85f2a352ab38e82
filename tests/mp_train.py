"""Run under ``accelerate launch`` by tests/test_multiprocess.py: train a config end to end and
report what the engine did. ``mode``: "train" (train, write OUT), "fail_save" (the main process
raises while saving a checkpoint: every process must exit with that error)."""
import sys

import torch

from flowgrpo import checkpoint as ckpt
from flowgrpo.config import load_config
from flowgrpo.trainer import Trainer
from tests.helpers import history_record, report_and_close

torch.set_num_threads(1)
mode, config_path, out_path = sys.argv[1], sys.argv[2], sys.argv[3]
trainer = Trainer(load_config(config_path))
acc = trainer.accelerator
if mode == "fail_save":
    def broken(*args, **kwargs):
        raise OSError("disk full while saving (injected by the test)")

    if acc.is_main_process:
        ckpt.save_checkpoint = broken
history = trainer.train()
record = {
    "num_processes": acc.num_processes,
    "engine": trainer.engine,
    "wrapper": type(trainer.engine_module).__name__,
    "wrapped_parameters": sorted(
        name for name, p in getattr(trainer.engine_module, "module", trainer.engine_module)
        .named_parameters() if p.requires_grad),
    "trainable": sorted(trainer.trainable),
    **history_record(history),
}
report_and_close(acc, out_path, record)
