"""Experiment trackers (``logging.report_to``: TensorBoard, Trackio, W&B, MLflow) for every stage.

- :mod:`.settings`   which trackers a run reports to, whether they are installed (nothing is imported
  to find out), where each keeps its data (local and offline unless the user configured otherwise),
  the one line that says so, and the run config as flat parameters.
- :mod:`.backends`   one class per tracker: start or continue the run, its last step, log, close.
- :mod:`.session`    the PPO / GRPO / RLOO run's trackers as one: each step once, also across a
  resume (the trackers' run ids in ``RUN_DIR/tracking.json``).
- :mod:`.hf`         the SFT and reward stages: ``report_to`` and the trackers' places for TRL's trainers.
- :mod:`.wandb_log`  reading W&B's local run files back (it has no API for that).
"""
