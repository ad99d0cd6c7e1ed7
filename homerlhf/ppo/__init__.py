"""RL from feedback (PPO, GRPO, RLOO): start with :mod:`.loop`, one iteration read top to bottom.

Its stages: :mod:`.collect` (rollout and scoring; :mod:`.asynchronous` a batch ahead), :mod:`.advantages`
(math: :mod:`.math`, :mod:`.group`), :mod:`.update` (the optimizer step), :mod:`.metrics`; :mod:`.trainer`
holds what lives across iterations. Checkpoints: :mod:`.checkpoint` (format, save, verify, load),
:mod:`.manifest` (what was written), :mod:`.rng`, :mod:`.resuming`.
"""
