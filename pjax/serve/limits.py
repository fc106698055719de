"""What one client may ask of the server (`pjax.serve.openai_api.create_app(limits=)`; `python -m pjax serve`'s
--max-request-bytes and --request-timeout). No dependencies: the command's flags read the defaults without the
`serve` extra."""
from __future__ import annotations

import dataclasses

__all__ = ["ServerLimits"]


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """max_body_bytes: a larger request body is a 413 (refused before it is read when its Content-Length says so);
    body_timeout_s: a body that has not fully arrived by then is a 408 (the command also closes a connection whose
    request head takes longer); parse_threads: threads that decode, check and tokenize requests off the event
    loop."""
    max_body_bytes: int = 8 * 2 ** 20
    body_timeout_s: float = 30.0
    parse_threads: int = 4
