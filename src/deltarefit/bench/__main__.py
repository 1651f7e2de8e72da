"""``python -m deltarefit.bench``: see :func:`deltarefit.bench.report.main`."""

from __future__ import annotations

import sys

from .report import main

sys.exit(main())
