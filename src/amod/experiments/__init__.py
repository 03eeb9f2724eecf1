"""Experiments and studies built on the library: the demo, the comparison with token merging, the
study the paper's review asks for, the frontier and calibration, analyses, linear probes and plots (the statistics
are in ``amod.stats``; the tools that measure or convert one model, ``amod eval``, ``export``, ``flops`` and
``bench``, are ``amod.tools``)."""
