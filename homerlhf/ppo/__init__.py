"""PPO: pure math, rollout, experience, the trainer loop, KL controllers, checkpoints.

An iteration's stages: :mod:`.collect` (rollout and scoring), :mod:`.advantages`, :mod:`.update`,
:mod:`.metrics`; :mod:`.trainer` runs them in order and holds what lives across iterations.
Checkpoints: :mod:`.checkpoint` (format, save, verify, load), :mod:`.manifest` (what was written),
:mod:`.rng`, :mod:`.resuming`.
"""
