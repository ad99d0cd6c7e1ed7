"""Reference runs the monitor draws beside a run of the same task (:mod:`homerlhf.app.monitor_reference`):
JSON data, read through ``importlib.resources`` so an installed wheel finds them as a checkout does."""
