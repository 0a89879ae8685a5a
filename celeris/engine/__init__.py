"""The engine: Request / Scheduler / ModelRunner / Engine, one owner each (see STYLE.md)."""

from celeris.engine.engine import Engine, StepOutput
from celeris.engine.request import Request, RequestStatus
from celeris.engine.scheduler import QueueFullError, Scheduler

__all__ = ["Engine", "QueueFullError", "Request", "RequestStatus", "Scheduler", "StepOutput"]
