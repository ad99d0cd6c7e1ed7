"""The memory planner, runtime peak measurement, dynamic micro-batching."""
