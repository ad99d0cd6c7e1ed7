"""The memory planner, runtime peak measurement, dynamic micro-batching.

- :mod:`.shapes` model shapes (local config, hub cache, builtin table);
- :mod:`.planner` bytes per component per PPO phase, verdict, suggestions (``plan``, ``suggest``);
- :mod:`.render` tables and the stacked bar chart (``plan_figure``);
- :mod:`.peaks` measured peaks per phase (``PhaseMeter``);
- :mod:`.oom` OOM recovery by halving the micro-batch (``run_with_backoff``).
"""
