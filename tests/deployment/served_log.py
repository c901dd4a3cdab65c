"""A LiteLLM callback the fault test loads into each proxy it starts (``litellm_settings.callbacks:
served_log.handler``): one JSON line per call that ended, appended to the file ``$SERVED_LOG``.

A line: ``event`` ("ok" or "failed"), ``marker`` (the ``[req N]`` the test put in the prompt, None
for a health-check probe), ``api_base`` (the deployment called, without a trailing ``/``; None for
an flm one), ``error`` (the exception's class name and the start of its message; None for "ok"),
``start`` and ``end`` (the call's, ``time.time()`` seconds; the callback itself may run later). In the
front proxy every Router attempt is a call of its own, so its failed attempts are there too.
"""

from __future__ import annotations

import json
import os
import re
from datetime import datetime

from litellm.integrations.custom_logger import CustomLogger

MARKER = re.compile(r"\[req (\d+)\]")


class ServedLog(CustomLogger):
    async def async_log_success_event(self, kwargs, response_obj, start_time, end_time):
        self._write("ok", kwargs, None, start_time, end_time)

    async def async_log_failure_event(self, kwargs, response_obj, start_time, end_time):
        self._write("failed", kwargs, kwargs.get("exception"), start_time, end_time)

    @staticmethod
    def _write(event: str, kwargs: dict, error: BaseException | None, start: datetime, end: datetime) -> None:
        text = " ".join(str(m.get("content")) for m in kwargs.get("messages") or [] if isinstance(m, dict))
        found = MARKER.search(text)
        api_base = (kwargs.get("litellm_params") or {}).get("api_base")
        line = {"event": event, "marker": int(found.group(1)) if found else None,
                "api_base": api_base.rstrip("/") if api_base else None,
                "error": f"{type(error).__name__}: {str(error)[:160]}" if error is not None else None,
                "start": start.timestamp(), "end": end.timestamp()}
        with open(os.environ["SERVED_LOG"], "a") as f:  # one write of one line: whole under O_APPEND
            f.write(json.dumps(line) + "\n")


handler = ServedLog()
