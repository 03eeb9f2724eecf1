"""The tools: commands that measure or convert one model, not studies. ``evaluate`` (`amod eval`: accuracy, loss,
cost and speed of a saved model), ``export_command`` (`amod export` around ``amod.deploy``), ``flops_command``
(`amod flops` around ``amod.cost``), ``bench`` (`amod bench`, and the one timing loop that the studies, the
benchmarks and ``amod.detect`` time with: ``time_callables``, ``time_models``, ``TimingRounds``) and ``opcount`` (the
operations one forward dispatches). Part of the application: above ``amod.train``, below ``amod.experiments``,
``amod.detect`` and ``amod.dense``, which import it."""
