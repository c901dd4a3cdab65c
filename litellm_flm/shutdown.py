"""A LiteLLM proxy's SIGTERM drains the flm engines (``flm_runtime.drain``) before the server stops.

What a proxy (``litellm --config``: uvicorn 0.54 under LiteLLM 1.110) does on SIGTERM: uvicorn's
handler sets its exit flag, and within 0.1 s its main loop closes the listening socket (a new
connection is refused from then on) and the idle connections, then waits for the responses under
way, up to LiteLLM's ``GRACEFUL_SHUTDOWN_TIMEOUT`` (30 s by default), before it cancels what is
left; then the app's shutdown, after which uvicorn raises SIGTERM again under the default handler,
so the process ends by the signal (status -15, as any uvicorn server), not with status 0.

``drain_on_sigterm`` wraps the SIGTERM handler in place, so that the signal first starts the drain
on a thread of its own (the server's event loop must go on streaming) and then calls the handler
it wrapped (uvicorn's, or LiteLLM's wrapper of it): chained, never replaced. The engines refuse
new requests at once with ``EngineDrainingError``, a 503 that a Router in front retries on another
deployment (what uvicorn still reads, a request whose body was under way, gets it), while the
streams under way run to their end within ``FLM_DRAIN_TIMEOUT_S``; those left end with that
error, and the engines close with their KV pools free.

Installed only where a proxy serves: ``litellm_flm``'s import calls it, and it acts from the main
thread of a process that loaded LiteLLM's proxy server, with a Python SIGTERM handler to chain to
(the proxy imports ``litellm_flm`` when its lifespan loads the config, inside uvicorn's handlers).
An SDK user's process keeps its signal handlers as they were.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType

from flm_runtime import FlmError

_log = logging.getLogger(__name__)

PROXY_SERVER = "litellm.proxy.proxy_server"  # the module a LiteLLM proxy's process has loaded


def drain_runtime() -> bool:
    """``flm_runtime.drain()``, imported when called: ``import litellm_flm`` stays cheap."""
    from flm_runtime import drain

    return drain()


def drain_on_sigterm(drain: Callable[[], bool] = drain_runtime) -> bool:
    """Wrap the SIGTERM handler so that the signal starts ``drain`` on a thread, then calls the
    wrapped handler; only inside a proxy's server (module docstring). Idempotent.

    Args:
        drain: what the signal starts: ``flm_runtime.drain`` (its bound: ``FLM_DRAIN_TIMEOUT_S``);
            returns whether every request finished.

    Returns:
        whether the wrapper is in place.
    """
    if threading.current_thread() is not threading.main_thread() or PROXY_SERVER not in sys.modules:
        return False
    previous = signal.getsignal(signal.SIGTERM)
    if getattr(previous, "drains_flm", False):
        return True
    if not callable(previous):  # no server's handler to chain to
        return False

    def drain_then_chain(signum: int, frame: FrameType | None) -> None:
        threading.Thread(target=_drain, args=(drain,), name="flm-drain").start()
        previous(signum, frame)

    drain_then_chain.drains_flm = True
    signal.signal(signal.SIGTERM, drain_then_chain)
    _log.info("SIGTERM drains the flm engines, then calls the server's handler")
    return True


def _drain(drain: Callable[[], bool]) -> None:
    """Run ``drain``, saying how it went."""
    try:
        finished = drain()
    except FlmError as e:  # a bad FLM_DRAIN_TIMEOUT_S: the server stops without a drain
        _log.error("the flm engines were not drained: %s", e)
        return
    _log.info("flm engines drained: %s", "every request finished" if finished else "the bound cut the requests left")
