-- The Prefect server's database, beside the ledger's (POSTGRES_DB=ddiloco): each keeps its own
-- Alembic version table and its own tables (both define an `events` table).
CREATE DATABASE prefect OWNER ddiloco;
