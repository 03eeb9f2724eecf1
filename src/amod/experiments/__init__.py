"""Experiments and commands built on the library: the demo, the comparison with token merging, the
study the paper's review asks for, ``amod eval`` and ``amod export`` of a checkpoint, analyses,
benchmarks, linear probes, statistics and plots."""
