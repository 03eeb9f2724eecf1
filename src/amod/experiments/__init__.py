"""Experiments built on the library: the demo, the comparison with token merging, the study the
paper's review asks for, analyses, benchmarks, linear probes, statistics and plots."""
