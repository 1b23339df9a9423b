"""The resources floor: what the package reads from outside itself, checked before it is used, and the processes
it starts. Model loading and the wholeness checks (:mod:`.loading`, :mod:`.wholeness`, :mod:`.agreement`), safetensors headers (:mod:`.tensorfile`),
trained checkpoint configs (:mod:`.trained`), detector region files (:mod:`.regions`), METEOR's paraphrase index
and the JVMs of the classic metrics (:mod:`.meteor_table`, its build :mod:`.meteor_build`, :mod:`.java`). It stands on :mod:`capeval_plugins.core`
(numerics on data passed in) and beside :mod:`capeval_plugins.files` (every file the package writes); everything
above it passes the core data, never a path.
"""
