"""The engine: Request / Scheduler / ModelRunner / Engine, one owner each; kv.py holds its KV memory, verified.py
and blocks.py its verified and block paths."""

from celeris.engine.engine import Engine, EngineStats, StepOutput
from celeris.engine.request import Request, RequestStatus
from celeris.engine.scheduler import QueueFullError, Scheduler

__all__ = ["Engine", "EngineStats", "QueueFullError", "Request", "RequestStatus", "Scheduler", "StepOutput"]
