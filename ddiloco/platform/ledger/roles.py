"""Least privilege on a PostgreSQL ledger: the roles of ``ddiloco ledger roles``, their grants and row-level security.

Four NOLOGIN group roles, named ``{prefix}_{kind}``:

- ``synchronizer``: reads everything it merges from; writes runs and fragment layouts, fates of submissions,
  versions, heads, merges, leases, events and learners' statuses. The training flow's supervisor uses it too.
- ``evaluator``: reads the newest versions and the token accounting; writes evaluations.
- ``dashboard``: SELECT only, in read-only transactions.
- ``learner``: reads the run's status and fragment heads; inserts and updates only its own rows. A learner's
  login role is named ``{prefix}_learner_{learner id}``: row-level security compares ``current_user`` with that
  name, so one login role can write as one learner and no other.

Nobody may DELETE or TRUNCATE; nobody but the ledger's owner (who runs migrations and this command) may change the
schema. The grants list exact columns where a role writes only some, and never a serial ``id``: a role that could
pick ids could collide with the sequence and block everyone else's inserts. One prefix per ledger database."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from sqlalchemy import Connection, func, literal_column, text
from sqlalchemy.dialects import postgresql

import ddiloco.platform.ledger.learner as learner_q
import ddiloco.platform.ledger.rejections as rejections_q
from ddiloco.platform.ids import validate_id
from ddiloco.platform.ledger.models import PENDING, Base, Learner, RejectionTotal, Submission
from ddiloco.platform.redact import MASK

SYNCHRONIZER, EVALUATOR, DASHBOARD, LEARNER = "synchronizer", "evaluator", "dashboard", "learner"
GROUPS = (SYNCHRONIZER, EVALUATOR, DASHBOARD, LEARNER)
LOGIN_KINDS = (SYNCHRONIZER, EVALUATOR, DASHBOARD)
"""Groups that ``--login KIND=NAME`` may add a login role to (a learner's login is named after the learner)."""
MAX_ROLE_NAME = 63
"""PostgreSQL truncates longer identifiers (NAMEDATALEN - 1)."""
_PREFIX = re.compile(r"^[a-z][a-z0-9_]{0,19}$")
_LOGIN = re.compile(r"^[a-z][a-z0-9_]{0,62}$")

DECISIONS = ("merged_version", "merge_id", "reject_reason", "decided_at", "norm", "weight", "staleness")
"""Columns of a submission that only the synchronizer writes: what became of it."""
OWN_ROWS = {"learners": "id", "heartbeats": "learner_id", "submissions": "learner_id", "events": "actor"}
"""Tables a learner writes, and the column naming the learner a row belongs to (row-level security)."""


def _columns(table: str, *, without: Sequence[str] = ()) -> list[str]:
    """The table's columns except its primary key, a serial id and ``without``."""
    t = Base.metadata.tables[table]
    return [c.name for c in t.columns if not c.primary_key and c.name not in without]


def _insert(table: str, *, without: Sequence[str] = ()) -> str:
    t = Base.metadata.tables[table]
    serial = t.autoincrement_column
    names = [c.name for c in t.columns if c is not serial and c.name not in without]
    return f"INSERT ({', '.join(names)})"


def _update(columns: Sequence[str]) -> str:
    return f"UPDATE ({', '.join(columns)})"


def grants() -> dict[str, dict[str, tuple[str, ...]]]:
    """Each group's privileges per table: exactly what its process's queries use (``tests/test_ledger_roles.py``)."""
    everything = {t: ("SELECT",) for t in Base.metadata.tables}
    return {
        SYNCHRONIZER: {
            "runs": ("SELECT", _insert("runs"), _update(["status", "finished_at", "tokens_rejected", "submissions_rejected"])),
            "fragment_specs": ("SELECT", _insert("fragment_specs")),
            "learners": ("SELECT", _update(["status"])),
            "submissions": ("SELECT", _update(["status", *DECISIONS, "blob_deleted"])),
            "fragment_versions": ("SELECT", _insert("fragment_versions"), _update(["blob_deleted", "gc_done"])),
            "fragment_heads": ("SELECT", _insert("fragment_heads"), _update(_columns("fragment_heads"))),
            "merges": ("SELECT", _insert("merges")),
            "events": ("SELECT", _insert("events")),
            "evaluations": ("SELECT",),
            "rejection_totals": ("SELECT", _insert("rejection_totals"), _update(_columns("rejection_totals"))),
            "synchronizer_leases": ("SELECT", _insert("synchronizer_leases"), _update(_columns("synchronizer_leases"))),
        },
        EVALUATOR: {
            "runs": ("SELECT",),
            "learners": ("SELECT",),
            "submissions": ("SELECT",),
            "fragment_heads": ("SELECT",),
            "evaluations": ("SELECT", _insert("evaluations")),
        },
        DASHBOARD: everything,
        LEARNER: {
            "runs": ("SELECT",),
            "fragment_heads": ("SELECT",),
            "learners": ("SELECT", _insert("learners"), _update(_columns("learners"))),
            "heartbeats": ("SELECT", _insert("heartbeats")),
            # What a learner says about its submission; status and blob_deleted only as row security allows.
            "submissions": ("SELECT", _insert("submissions", without=DECISIONS)),
            "events": ("SELECT", _insert("events")),
        },
    }


@dataclass(frozen=True)
class RolePlan:
    """What ``ddiloco ledger roles`` sets up: the groups of ``prefix``, login roles, and their passwords."""

    prefix: str = "ddiloco"
    learners: tuple[str, ...] = ()
    """Learner ids that get a login role ``{prefix}_learner_{id}``."""
    logins: tuple[tuple[str, str], ...] = ()
    """(group kind, login role name) pairs: a synchronizer's, evaluator's or dashboard's own login role."""
    schema: str = "public"
    """The schema of the ledger's tables (the SECURITY DEFINER function's search path)."""
    passwords: Mapping[str, str] = field(default_factory=dict)
    """SCRAM verifiers by login role name (never a plain password: the server never sees one)."""

    def __post_init__(self) -> None:
        if not _PREFIX.fullmatch(self.prefix):
            raise ValueError(f"role prefix {self.prefix!r} is not valid: use 1-20 lowercase letters, digits or '_', starting with a letter")
        for learner in self.learners:
            validate_id(learner, "learner")
            if len(self.learner_login(learner)) > MAX_ROLE_NAME:
                raise ValueError(
                    f"learner {learner!r}: its role name {self.learner_login(learner)!r} is longer than PostgreSQL's "
                    f"{MAX_ROLE_NAME} characters; use a shorter learner id or --prefix"
                )
        for kind, name in self.logins:
            if kind not in LOGIN_KINDS:
                raise ValueError(f"login kind {kind!r} is not one of {', '.join(LOGIN_KINDS)}")
            if not _LOGIN.fullmatch(name) or name.startswith(f"{self.prefix}_learner"):
                raise ValueError(
                    f"login role name {name!r} is not valid: use 1-63 lowercase letters, digits or '_', starting with a "
                    f"letter, not starting with {self.prefix}_learner"
                )

    def group(self, kind: str) -> str:
        return f"{self.prefix}_{kind}"

    def learner_login(self, learner: str) -> str:
        """The login role of a learner: row security reads the learner id back from this name."""
        return f"{self.group(LEARNER)}_{learner}"

    def login_roles(self) -> list[tuple[str, str]]:
        """(group kind, login role name) of every login role the plan creates."""
        return [(LEARNER, self.learner_login(lid)) for lid in self.learners] + list(self.logins)


def _ident(name: str) -> str:
    return postgresql.dialect().identifier_preparer.quote(name)


def _literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _ensure_role(name: str, *, login: bool) -> str:
    """Create the role when missing; refuse one that bypasses row security (a superuser's name, say)."""
    create = f"CREATE ROLE {_ident(name)} {'LOGIN' if login else 'NOLOGIN'}"
    return (
        "DO $$ BEGIN\n"
        f"  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = {_literal(name)}) THEN {create}; END IF;\n"
        f"  IF EXISTS (SELECT FROM pg_roles WHERE rolname = {_literal(name)} AND (rolsuper OR rolbypassrls)) THEN\n"
        f"    RAISE EXCEPTION 'role {name} is a superuser or bypasses row-level security: pick another --prefix';\n"
        "  END IF;\n"
        "END $$"
    )


def _me(plan: RolePlan, column: str) -> str:
    """SQL: the row's learner is the one the current login role stands for."""
    return f"current_user::text = {_literal(plan.group(LEARNER) + '_')} || {column}"


def _policies(plan: RolePlan) -> list[str]:
    """Row-level security on the tables learners write: learners see and write their own rows, others as granted."""
    sync, readers, learner = plan.group(SYNCHRONIZER), f"{plan.group(EVALUATOR)}, {plan.group(DASHBOARD)}", plan.group(LEARNER)
    out = []
    for table, column in OWN_ROWS.items():
        me = _me(plan, column)
        check = me
        if table == "submissions":  # a new submission waits for its fate; its blob is not collected
            check = f"{me} AND status = {_literal(PENDING)} AND blob_deleted = false"
        policies = {
            f"{plan.prefix}_synchronizer": f"FOR ALL TO {sync} USING (true) WITH CHECK (true)",
            f"{plan.prefix}_readers": f"FOR SELECT TO {readers} USING (true)",
            f"{plan.prefix}_learner_reads": f"FOR SELECT TO {learner} USING ({me})",
            f"{plan.prefix}_learner_inserts": f"FOR INSERT TO {learner} WITH CHECK ({check})",
        }
        if any(p.startswith("UPDATE") for p in grants()[LEARNER][table]):
            policies[f"{plan.prefix}_learner_updates"] = f"FOR UPDATE TO {learner} USING ({me}) WITH CHECK ({me})"
        out.append(f"ALTER TABLE {table} ENABLE ROW LEVEL SECURITY")
        for name, body in policies.items():
            out += [f"DROP POLICY IF EXISTS {name} ON {table}", f"CREATE POLICY {name} ON {table} {body}"]
    return out


def _sql(statement: object) -> str:
    return str(statement.compile(dialect=postgresql.dialect(), compile_kwargs={"literal_binds": True}))  # type: ignore[attr-defined]


def reject_superseded_function(plan: RolePlan) -> str:
    """CREATE FUNCTION: a learner's login role rejects its own pending submissions of a superseded incarnation
    (``learner._reject_superseded``) with the synchronizer's rights, through the very statements the synchronizer's
    rejections run (``rejections.rejection``, ``rejections.count_rejected``)."""
    p = {name: literal_column(name) for name in ("p_run", "p_learner", "p_ids", "p_reason", "p_at")}
    mine = (Submission.id == func.any(p["p_ids"])) & (Submission.learner_id == p["p_learner"])
    reject = _sql(rejections_q.rejection(p["p_run"], mine, p["p_reason"], p["p_at"]))
    count = _sql(rejections_q.count_rejected(p["p_run"], literal_column("v_tokens"), literal_column("v_count")))
    totals = {"run_id": p["p_run"], "learner_id": p["p_learner"], "reason": literal_column("v_class"),
              "submissions": literal_column("v_count"), "tokens": literal_column("v_tokens"), "nbytes": literal_column("v_bytes")}
    count_by = _sql(rejections_q.count_rejected_by(postgresql.insert(RejectionTotal), [totals]))
    learners = Learner.__tablename__
    superseded, unknown = (_literal(rejections_q.reason_class(why)) for why in (learner_q.SUPERSEDED, learner_q.UNKNOWN_LEARNER))
    return f"""CREATE OR REPLACE FUNCTION {learner_q.REJECT_SUPERSEDED}(
    p_run text, p_learner text, p_incarnation integer, p_ids bigint[], p_reason text, p_at timestamptz
) RETURNS bigint LANGUAGE plpgsql SECURITY DEFINER SET search_path = {_ident(plan.schema)}, pg_temp AS $fn$
DECLARE v_count bigint; v_tokens bigint; v_bytes bigint; v_class text;
BEGIN
  IF session_user::text <> {_literal(plan.group(LEARNER) + '_')} || p_learner THEN
    RAISE EXCEPTION 'role % may not reject submissions of learner %', session_user, p_learner USING ERRCODE = '42501';
  END IF;
  IF EXISTS (SELECT FROM {learners} WHERE run_id = p_run AND id = p_learner AND incarnation = p_incarnation) THEN
    RAISE EXCEPTION 'incarnation % of learner % is current, not superseded', p_incarnation, p_learner USING ERRCODE = '42501';
  END IF;
  v_class := CASE WHEN EXISTS (SELECT FROM {learners} WHERE run_id = p_run AND id = p_learner)
    THEN {superseded} ELSE {unknown} END;
  WITH decided AS ({reject}) SELECT count(*), coalesce(sum(tokens_new), 0), coalesce(sum(nbytes), 0)
    INTO v_count, v_tokens, v_bytes FROM decided;
  IF v_count <> cardinality(p_ids) THEN
    RAISE EXCEPTION '% of submissions % already have a fate', cardinality(p_ids) - v_count, p_ids;
  END IF;
  {count};
  {count_by};
  RETURN v_count;
END $fn$"""


def _one_prefix(plan: RolePlan) -> str:
    """Refuse a second prefix on the same ledger: the learners' function (one per database) belongs to the first."""
    return (
        "DO $$ DECLARE owner text; BEGIN\n"
        f"  SELECT pg_get_userbyid(proowner) INTO owner FROM pg_proc WHERE proname = {_literal(learner_q.REJECT_SUPERSEDED)}\n"
        f"    AND pronamespace = {_literal(plan.schema)}::regnamespace;\n"
        f"  IF owner IS NOT NULL AND owner <> {_literal(plan.group(SYNCHRONIZER))} THEN\n"
        "    RAISE EXCEPTION 'this ledger''s roles were set up with another prefix (its function belongs to %): use that --prefix',\n"
        "      owner;\n"
        "  END IF;\n"
        "END $$"
    )


def statements(plan: RolePlan) -> list[str]:
    """Every statement ``ddiloco ledger roles`` runs, in one transaction; running them again changes nothing."""
    out = [_one_prefix(plan), *(_ensure_role(plan.group(kind), login=False) for kind in GROUPS)]
    out.append(f"ALTER ROLE {plan.group(DASHBOARD)} SET default_transaction_read_only = on")
    for kind, name in plan.login_roles():
        out += [_ensure_role(name, login=True), f"GRANT {plan.group(kind)} TO {_ident(name)}"]
        if kind == DASHBOARD:  # a group's settings do not reach its members' sessions
            out.append(f"ALTER ROLE {_ident(name)} SET default_transaction_read_only = on")
        if name in plan.passwords:
            out.append(f"ALTER ROLE {_ident(name)} PASSWORD {_literal(plan.passwords[name])}")
    groups = ", ".join(plan.group(kind) for kind in GROUPS)
    tables = [*Base.metadata.tables, "alembic_version"]
    serials = {t.name: t.autoincrement_column for t in Base.metadata.sorted_tables if t.autoincrement_column is not None}
    sequences = {name: f"{name}_{column.name}_seq" for name, column in serials.items()}
    out += [f"REVOKE ALL ON {t} FROM {groups}" for t in tables]
    out += [f"REVOKE ALL ON SEQUENCE {s} FROM {groups}" for s in sequences.values()]
    for kind, by_table in grants().items():
        role = plan.group(kind)
        out.append(f"GRANT SELECT ON alembic_version TO {role}")
        for table, privileges in by_table.items():
            out.append(f"GRANT {', '.join(privileges)} ON {table} TO {role}")
            if table in sequences and any(p.startswith("INSERT") for p in privileges):
                out.append(f"GRANT USAGE ON SEQUENCE {sequences[table]} TO {role}")
    out += _policies(plan)
    signature = f"{learner_q.REJECT_SUPERSEDED}(text, text, integer, bigint[], text, timestamptz)"
    out += [
        reject_superseded_function(plan),
        f"ALTER FUNCTION {signature} OWNER TO {plan.group(SYNCHRONIZER)}",
        f"REVOKE ALL ON FUNCTION {signature} FROM PUBLIC",
        f"GRANT EXECUTE ON FUNCTION {signature} TO {plan.group(LEARNER)}",
    ]
    return out


def apply(conn: Connection, plan: RolePlan) -> None:
    """Run :func:`statements` in ``conn``'s transaction (as the ledger's owner)."""
    driver = conn.connection.driver_connection
    for statement in statements(plan):
        # Through the driver without parameters: the function bodies' '%' are not placeholders.
        driver.execute(statement)


def prefix_of(conn: Connection) -> str | None:
    """The prefix this ledger's roles were set up with (its learners' function belongs to the synchronizer group), or
    None where ``ddiloco ledger roles`` never ran."""
    owner = conn.execute(
        text("SELECT pg_get_userbyid(proowner) FROM pg_proc WHERE proname = :name AND pronamespace = current_schema()::regnamespace"),
        {"name": learner_q.REJECT_SUPERSEDED},
    ).scalar()
    suffix = f"_{SYNCHRONIZER}"
    return owner[: -len(suffix)] if owner and owner.endswith(suffix) else None


def shown(plan: RolePlan) -> str:
    """The statements as a script for ``--dry-run``, with password verifiers masked."""
    masked = RolePlan(plan.prefix, plan.learners, plan.logins, plan.schema, {name: MASK for name in plan.passwords})
    return "".join(f"{s};\n" for s in statements(masked))
