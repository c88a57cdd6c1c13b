"""The SQL ledger: models, migrations, engine set-up and the queries every component uses."""

from ddiloco.platform.ledger.engine import make_engine, open_ledger, session_factory, upgrade

__all__ = ["make_engine", "open_ledger", "session_factory", "upgrade"]
