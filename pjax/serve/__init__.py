"""Serving: the continuous-batching engine (`Engine`: requests join and leave a fixed device batch of slots between
device chunks) and its request / event types."""
from pjax.serve.engine import Engine, EngineConfig, Event, RequestParams

__all__ = ["Engine", "EngineConfig", "Event", "RequestParams"]
