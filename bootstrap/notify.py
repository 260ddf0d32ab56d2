"""SNS notifications a person reads: what happened, where, and what to do next."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from bootstrap.eventlog import EventLog

_SUBJECT_LIMIT = 100


class Notifier:
    """Publishes to the stack's topic; a failed publish is logged, never fatal (the ledger has the facts)."""

    def __init__(self, sns: Any, topic_arn: str, stack: str, log: EventLog) -> None:
        self._sns = sns
        self._topic_arn = topic_arn
        self._stack = stack
        self._log = log

    def publish(self, subject: str, lines: Iterable[str]) -> bool:
        full_subject = f"trainstack [{self._stack}]: {subject}"
        if len(full_subject) > _SUBJECT_LIMIT:
            # SNS refuses a longer subject; a visible cut tells the reader the body has the rest (job ids).
            full_subject = full_subject[: _SUBJECT_LIMIT - 1] + "…"
        message = "\n".join(lines)
        try:
            self._sns.publish(TopicArn=self._topic_arn, Subject=full_subject, Message=message)
        except Exception as exc:  # a notification must never take the instance life down with it
            self._log.event("notify", "SNS publish failed", topic=self._topic_arn, error=str(exc))
            return False
        self._log.event("notify", "SNS message sent", subject=full_subject)
        return True


def format_duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def format_metrics(metrics: dict[str, Any] | None) -> list[str]:
    """Scalar metrics, one per line; the trainer's `final` section (if any) is what a reader wants."""
    if not metrics:
        return ["  (no metrics.json found)"]
    final = metrics.get("final")
    lines = []
    for key, value in (final if isinstance(final, dict) else metrics).items():
        if isinstance(value, (int, float, str, bool)):
            lines.append(f"  {key}: {value:.4g}" if isinstance(value, float) else f"  {key}: {value}")
    return lines or ["  (metrics.json has no scalar values)"]
