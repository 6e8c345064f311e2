"""``dflash2-gguf bench``: acceptance length and speedup of a drafter on real prompt sets.

- :mod:`.cli`: the flags and :func:`~dflash2_gguf.bench.cli.run_from_args` (what the subcommand
  dispatches to);
- :mod:`.run`: the run loop; :mod:`.compare`: the side-by-side runs (upstream llama.cpp,
  llama-cpp-python's prompt lookup); :mod:`.report`: ``bench.json`` / ``bench.md`` / the plot;
  :mod:`.stats`: tau, histograms, per-position acceptance, tokens/s and speedups;
- :mod:`.prompt_sets`: the benchmark prompt sets (the table training capture uses too).

Importing this package imports nothing native and no other module of it.
"""
