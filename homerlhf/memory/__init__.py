"""The memory planner, runtime peak measurement, dynamic micro-batching.

- :mod:`.shapes` model shapes (local config, hub cache, builtin table);
- :mod:`.planner` the plan: bytes per component per PPO phase and a verdict (``plan``), from
  :mod:`.components` (byte counts) and :mod:`.phases` (what each phase holds at its peak);
- :mod:`.plans` a plan as data and its counting (``build_plan``), below :mod:`.search` the cheapest
  settings that fit (``suggest``) and :mod:`.chunks` the generation chunk the card affords
  (``planned_generation_chunk``);
- :mod:`.timing` seconds per iteration, :mod:`.placement` where the reference and reward run (``auto``);
- :mod:`.render` tables and the stacked bar chart (``plan_figure``);
- :mod:`.peaks` measured peaks per phase (``PhaseMeter``);
- :mod:`.oom` OOM recovery by halving the micro-batch (``run_with_backoff``).
"""
