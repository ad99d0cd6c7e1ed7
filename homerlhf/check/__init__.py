"""``homerlhf check``: the GPU code paths on the card it finds, run and measured against the planner
(:mod:`homerlhf.check.main`); the cases sized to the card (``cases``), one case's run (``run``), its
plan (``case_plan``), its other figures (``measures``), its line (``lines``), the ``cli`` case's
subprocess (``cli_case``), and what the GPU scripts share (``runs``)."""
