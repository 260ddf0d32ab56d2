"""Test-only fault injection: kill or signal this process at a named point, chosen by an env variable.

TRAINSTACK_FAULT="<sigterm|sigkill>:<point>:<key>=<value>,..." fires when the loop reaches <point>
with matching keys, e.g. "sigkill:checkpoint-state-written:step=10" or
"sigterm:micro-batch:step=5,micro=0". Unset (always, outside tests) it does nothing.
"""

from __future__ import annotations

import os
import signal

ENV = "TRAINSTACK_FAULT"


def fault_point(point: str, **context: int) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    action, _, rest = spec.partition(":")
    where, _, conditions = rest.partition(":")
    if where != point:
        return
    for condition in filter(None, conditions.split(",")):
        key, _, value = condition.partition("=")
        if context.get(key) != int(value):
            return
    os.kill(os.getpid(), signal.SIGKILL if action == "sigkill" else signal.SIGTERM)
