"""Running requests: prefill and decode over cache views. Not for: HTTP (see :mod:`replaykv.server`).

The Python API: build an :class:`EngineConfig`, start an :class:`Engine`, then ``submit`` a
:class:`Request` (stream its deltas) or call :func:`generate`::

    engine = Engine(EngineConfig(preset="small", store_dir=None))
    result = generate(engine, "Hello", max_tokens=16, temperature=0)
    engine.shutdown()
"""

from replaykv.engine.api import (
    Accounting,
    Delta,
    EngineError,
    InvalidRequest,
    QueueFull,
    Request,
    Result,
    SamplingParams,
)
from replaykv.engine.config import EngineConfig
from replaykv.engine.engine import Engine, EngineHandle, generate

__all__ = [
    "Accounting",
    "Delta",
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineHandle",
    "InvalidRequest",
    "QueueFull",
    "Request",
    "Result",
    "SamplingParams",
    "generate",
]
