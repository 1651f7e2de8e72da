"""The deltarefit benchmark: real AdamW and calibrated synthetic bf16 pairs, our codec vs. peers.

Run it with ``python -m deltarefit.apps.bench [--quick] [--out DIR] [--synthetic-params 1e8 ...]
[--threads N] [--markdown docs/BENCHMARKS.md]``. Modules:

* :mod:`.pairs`: checkpoint pairs (real AdamW steps on a pretrained BERT; calibrated synthetic pairs).
* :mod:`.peers`: byte counts of the peers (raw, zstd -1, NeMo-style, TRL-style, ZipNN), with decoders.
* :mod:`.chains`: version chains v0..v{n-1} (a real AdamW run; a real GRPO run on a small LLaMA),
  ``python -m deltarefit.apps.bench.chains OUT_DIR [--kind adamw|rl]``.
* :mod:`.entropy`: the empirical conditional entropy bound H(D | base exponent, tensor).
* :mod:`.report`: the driver and :func:`main`; :mod:`.report_render`: the table, ``docs/BENCHMARKS.md``,
  the plot.
* :mod:`.per_element`: ns per changed element per core of decode, scatter, read-back and digest, and the fixed
  cost per refit, for the file, torch and engine-like targets (``docs/PERFORMANCE.md``).
* :mod:`.engine`: refit of a running vLLM engine, in place against disk + reload and full reload
  (``python -m deltarefit.apps.bench.engine``, needs vLLM; ``docs/ENGINES.md``).

Our codec is imported lazily (``deltarefit.encode`` / ``deltarefit.apply``); without it the rest of
the benchmark still runs and reports "ours" as unavailable. torch/transformers are only imported to
make the AdamW pairs.
"""

from __future__ import annotations

from .entropy import EntropyBound, entropy_bound, ulp_distance, ulp_key
from .pairs import Calibration, Pair, calibrate, make_adamw_pairs, make_synthetic_pair
from .report import main, run_bench, write_markdown

__all__ = [
    "Calibration",
    "EntropyBound",
    "Pair",
    "calibrate",
    "entropy_bound",
    "main",
    "make_adamw_pairs",
    "make_synthetic_pair",
    "run_bench",
    "ulp_distance",
    "ulp_key",
    "write_markdown",
]
