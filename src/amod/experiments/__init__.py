"""Experiments and commands built on the library: the demo, the comparison with token merging, the
study the paper's review asks for, the frontier and calibration, ``amod eval`` and ``amod export`` of a
checkpoint, analyses, benchmarks, linear probes and plots (the statistics are in ``amod.stats``)."""
