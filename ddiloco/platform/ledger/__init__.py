"""The SQL ledger: models, migrations, engine set-up, and the queries in a module per caller role: ``runs`` (what
every role reads of a run), ``learner``, ``synchronizer``, ``reports`` (summary, dashboard, ``ledger check``),
``dashboard`` (the dashboard's other reads), ``rejections`` and ``errors``. Callers import each module under its alias
(``runs_q``, ``learner_q``, ``sync_q``, ``reports_q``, ``dash_q``, ``rejections_q``, ``errors_q``)."""

from ddiloco.platform.ledger.engine import make_engine, open_ledger, session_factory, upgrade

__all__ = ["make_engine", "open_ledger", "session_factory", "upgrade"]
