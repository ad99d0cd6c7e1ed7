"""The memory planner, runtime peak measurement, dynamic micro-batching.

- :mod:`.shapes` model shapes (local config, hub cache, builtin table);
- :mod:`.planner` the plan: bytes per component per PPO phase and a verdict (``plan``), from
  :mod:`.components` (byte counts) and :mod:`.phases` (what each phase holds at its peak);
- :mod:`.search` the cheapest settings that fit (``suggest``);
- :mod:`.render` tables and the stacked bar chart (``plan_figure``);
- :mod:`.peaks` measured peaks per phase (``PhaseMeter``);
- :mod:`.oom` OOM recovery by halving the micro-batch (``run_with_backoff``).
"""
