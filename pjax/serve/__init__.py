"""Serving: the continuous-batching engine (`pjax.decode.Engine`, re-exported here with its request / event types:
requests join and leave a fixed device batch of slots between device chunks); `AsyncEngine` runs an Engine on its own
thread for asyncio servers. The OpenAI-compatible HTTP app is `pjax.serve.openai_api` (the `serve` extra), its
command `python -m pjax serve`."""
from pjax.decode.engine import Engine, EngineConfig, Event, RequestParams
from pjax.serve.async_engine import AsyncEngine, EngineDeadError, RequestStream

__all__ = ["AsyncEngine", "Engine", "EngineConfig", "EngineDeadError", "Event", "RequestParams", "RequestStream"]
