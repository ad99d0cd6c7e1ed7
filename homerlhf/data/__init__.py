"""Dataset loading and normalisation to prompt and preference records, plus the builtin task.

:mod:`.read` gets raw rows (builtin, file, hub), :mod:`.formats` converts rows to records,
:mod:`.load` puts them together with a report, :mod:`.tokens` renders and encodes records;
:mod:`.builtin` is the offline polite/on-topic task.
"""
