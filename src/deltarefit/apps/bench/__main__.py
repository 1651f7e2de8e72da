"""``python -m deltarefit.apps.bench``: see :func:`deltarefit.apps.bench.report.main`."""

from __future__ import annotations

import sys

from .report import main

sys.exit(main())
