"""Stands in for the RL loop (not written yet) in the Slurm tests, keeping the trainer's contract
with the launcher: connect to the job's Ray cluster with ray.init(address="auto"); on SIGTERM,
save a checkpoint and exit 0; when a checkpoint exists, resume from it. Ignores its arguments
(the experiment config). The checkpoint is the file named by FAKE_TRAINER_CHECKPOINT."""
import os
import signal
import sys
import time
from pathlib import Path

import ray

checkpoint = Path(os.environ["FAKE_TRAINER_CHECKPOINT"])
ray.init(address="auto", log_to_driver=False, logging_level="ERROR")
print(f"fake trainer: connected to Ray, {ray.cluster_resources().get('GPU', 0):g} GPU(s)", flush=True)
ray.shutdown()
if checkpoint.exists():
    print(f"fake trainer: resumed from checkpoint at step {checkpoint.read_text()}; finished", flush=True)
    sys.exit(0)
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
print("fake trainer: training", flush=True)
step = 0
while not stop:
    if step == 1200:  # 2 minutes without the expected SIGTERM
        sys.exit("fake trainer: no SIGTERM came")
    time.sleep(0.1)
    step += 1
checkpoint.write_text(str(step))
print(f"fake trainer: checkpoint saved at step {step}", flush=True)
