"""The decoder: the Python side of the native DFlash driver.

- :mod:`.api`: :class:`~dflash2_gguf.decoder.api.DFlashDecoder` (models, generation, streaming),
  its results and statistics.
- :mod:`.cost_cache`: the cost models of the adaptive draft length kept between runs
  (``<cache>/cost-models.json``).
- :mod:`.sampling`: :class:`~dflash2_gguf.decoder.sampling.SamplingParams` and the sampling math
  as numpy twins of the native code.
- :mod:`.params`: the one table of generation parameters (flags, request fields, native fields).
- :mod:`.detok`: streaming detokenization.

The public names are importable from :mod:`dflash2_gguf` itself (``from dflash2_gguf import
DFlashDecoder, SamplingParams``); importing this package loads nothing native.
"""
