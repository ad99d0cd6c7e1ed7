"""The presets: one YAML memory plan per card (``homerlhf presets`` lists them), read through
``importlib.resources`` so an installed wheel finds them as a checkout does."""
