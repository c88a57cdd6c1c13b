"""Alerts as Prefect automations, sent through a notification block the user names; and the events
the training run's supervisor emits for them.

- ``ddiloco: no new global version``: no ``ddiloco.version.published`` event of a run for X minutes
  after its last one (or after ``ddiloco.run.started``);
- ``ddiloco: learner relaunched repeatedly``: more than N ``ddiloco.learner.relaunched`` events of one
  learner within an hour;
- ``ddiloco: flow run crashed``: any ddiloco flow run entering Crashed.

``ddiloco deploy --notify-block TYPE/NAME`` creates or updates them (matched by name)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prefect.events import Event

log = logging.getLogger("ddiloco.flows")

PREFIX = "ddiloco: "
RUN_RESOURCE = "ddiloco.run.{run_id}"
LEARNER_RESOURCE = "ddiloco.learner.{run_id}.{learner_id}"


MIN_STALL_MINUTES = 10 / 60
"""Prefect's shortest window for a trigger on the absence of events (a proactive trigger): 10 seconds."""


@dataclass(frozen=True)
class AlertPolicy:
    stall_minutes: float = 10.0
    """Alert when a run publishes no global version for this long (fractions allowed: 0.5 is 30 seconds)."""
    relaunches_per_hour: int = 3
    """Alert when one learner is relaunched more often than this within an hour."""

    def __post_init__(self) -> None:
        if not MIN_STALL_MINUTES <= self.stall_minutes <= 7 * 24 * 60:
            raise ValueError(f"--stall-minutes {self.stall_minutes}: expected a number of minutes in [{MIN_STALL_MINUTES:.3g} "
                             "(10 s, Prefect's shortest window for an absence of events), 10080]")
        if not 0 <= self.relaunches_per_hour <= 10_000:
            raise ValueError(f"--relaunches-per-hour {self.relaunches_per_hour}: expected 0..10000")


CLOSING_EVENTS = frozenset({"ddiloco.run.finished"})
"""Events the server must evaluate after the previous event of their resource. It evaluates a few events
at once: a run's last ``version.published``, sent a moment before ``run.finished``, could be evaluated
after it and open a stall window nothing would close (a stall alert after every finished run). Other
events need no order (a late ``version.published`` is ignored, relaunches are counted), and a follower
of an event the server never saw (one sent before it restarted) would wait 15 minutes to be evaluated."""

_last_event: dict[str, Event] = {}
"""The last event this process emitted about each resource: a closing event names it as the one it follows."""


def emit(event: str, resource_id: str, **labels: str) -> None:
    """A Prefect event for the automations; nothing without Prefect or a Prefect server to send it to."""
    try:
        from prefect.events import emit_event
        from prefect.settings import PREFECT_API_URL
    except ModuleNotFoundError:
        return
    if not PREFECT_API_URL.value():
        return  # Prefect's temporary server (the demo) has no automations: starting one for an event would cost seconds
    follows = _last_event.get(resource_id) if event in CLOSING_EVENTS else None
    try:
        sent = emit_event(event=event, resource={"prefect.resource.id": resource_id, **labels}, follows=follows)
    except Exception as err:  # noqa: BLE001 - an alert's event must never stop a training run
        log.warning("could not emit Prefect event %s: %s", event, err)
        return
    if sent is not None:
        _last_event[resource_id] = sent


def automations(block_document_id: object, policy: AlertPolicy) -> list:
    """The three automations, each notifying through the block ``block_document_id``."""
    from prefect.automations import Automation, EventTrigger, Posture, SendNotification

    def notify(subject: str, body: str) -> list:
        return [SendNotification(block_document_id=block_document_id, subject=subject, body=body)]

    stall = timedelta(minutes=policy.stall_minutes)
    return [
        Automation(
            name=PREFIX + "no new global version",
            description=f"A run published no global version for {policy.stall_minutes:g} minutes.",
            trigger=EventTrigger(
                match={"prefect.resource.id": "ddiloco.run.*"},
                after={"ddiloco.run.started", "ddiloco.version.published"},
                expect={"ddiloco.version.published", "ddiloco.run.finished"},
                for_each={"prefect.resource.id"},
                posture=Posture.Proactive,
                threshold=1,
                within=stall,
            ),
            actions=notify("ddiloco: no new global version",
                           f"{{{{ event.resource.id }}}} published no global version for {policy.stall_minutes:g} minutes."),
        ),
        Automation(
            name=PREFIX + "learner relaunched repeatedly",
            description=f"A learner was relaunched more than {policy.relaunches_per_hour} times within an hour.",
            trigger=EventTrigger(
                match={"prefect.resource.id": "ddiloco.learner.*"},
                expect={"ddiloco.learner.relaunched"},
                for_each={"prefect.resource.id"},
                posture=Posture.Reactive,
                threshold=policy.relaunches_per_hour + 1,
                within=timedelta(hours=1),
            ),
            actions=notify("ddiloco: learner relaunched repeatedly",
                           f"{{{{ event.resource.id }}}} was relaunched more than {policy.relaunches_per_hour} times within an hour."),
        ),
        Automation(
            name=PREFIX + "flow run crashed",
            description="A ddiloco flow run crashed.",
            trigger=EventTrigger(
                match={"prefect.resource.id": "prefect.flow-run.*"},
                match_related={"prefect.resource.role": "flow", "prefect.resource.name": "ddiloco-*"},
                expect={"prefect.flow-run.Crashed"},
                posture=Posture.Reactive,
                threshold=1,
                within=timedelta(0),
            ),
            actions=notify("ddiloco: flow run crashed", "Flow run {{ event.resource.name }} crashed: {{ event.payload }}"),
        ),
    ]


def apply_automations(notify_block: str, policy: AlertPolicy | None = None) -> list[str]:
    """Create or update the automations (by name) to notify through the block ``TYPE/NAME``; their names."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    block_type, sep, name = notify_block.partition("/")
    if not sep or not block_type or not name:
        raise ValueError(f"--notify-block {notify_block!r}: expected TYPE/NAME of a notification block, e.g. slack-webhook/ops")
    with get_client(sync_client=True) as client:
        try:
            block = client.read_block_document_by_name(name=name, block_type_slug=block_type)
        except ObjectNotFound:
            raise ValueError(f"--notify-block {notify_block!r}: no such block on the Prefect server") from None
        existing = {a.name: a for a in client.read_automations()}
    names = []
    for automation in automations(block.id, policy or AlertPolicy()):
        old = existing.get(automation.name)
        if old is not None:
            automation.id = old.id
            automation.update()
        else:
            automation.create()
        names.append(automation.name)
    return names
