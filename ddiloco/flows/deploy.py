"""Create the work pools (one per region) and the deployments of a run against any Prefect API."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.deployments.runner import EntrypointType
from prefect.exceptions import ObjectAlreadyExists

from ddiloco.flows.alerts import AlertPolicy, apply_automations
from ddiloco.flows.training import evaluate_flow, learner_flow, synchronizer_flow, training_run
from ddiloco.platform.config import RunConfig
from ddiloco.platform.redact import redact_url

POOL_PREFIX = "region-"


@dataclass(frozen=True)
class DeploymentPlan:
    pools: list[str]
    deployments: list[str]
    automations: list[str] = field(default_factory=list)


def pool_name(region: str) -> str:
    return f"{POOL_PREFIX}{region}"


ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")
BLOCK_NAME = re.compile(r"^[a-z0-9][a-z0-9-]*$")
LOGGING_ENV = {"PREFECT_LOGGING_EXTRA_LOGGERS": "ddiloco"}
"""Flow-run processes send the ``ddiloco.*`` loggers' records to the Prefect UI, not only the flow's own."""


CREDENTIAL_KEYS = frozenset({"key", "secret", "token", "password", "aws_access_key_id", "aws_secret_access_key",
                             "aws_session_token", "access_key", "secret_key", "session_token"})
"""fsspec options that are credentials (s3fs, gcsfs, botocore names): never copied into a deployment."""


def _keys(tree: object) -> set[str]:
    """Every key of a nested dict, lower-cased."""
    if not isinstance(tree, dict):
        return set()
    return {str(k).lower() for k in tree} | set().union(*(_keys(v) for v in tree.values()))


def parse_secret_blocks(items: list[str]) -> dict[str, str]:
    """``ENV_VAR=block-name`` pairs: each flow run's ``ENV_VAR`` is the value of that Prefect Secret
    block, read by the worker when it starts the run; refuses anything else with a one-line error."""
    out = {}
    for item in items:
        var, sep, block = item.partition("=")
        if not sep or not ENV_NAME.match(var) or not BLOCK_NAME.match(block):
            raise ValueError(f"--secret-block {item!r}: expected ENV_VAR=block-name, e.g. DDILOCO_LEDGER__URL=ddiloco-ledger-url")
        out[var] = block
    return out


def region_env(cfg: RunConfig, region: str, secret_blocks: dict[str, str] | None = None) -> dict[str, str]:
    """What a region's worker passes to its flow runs: where its bucket is, and the *names* of the
    Secret blocks that hold credentials (the ledger URL among them), never their values.

    A secret without a block comes from the worker's own environment (``DDILOCO_LEDGER__URL``,
    ``AWS_SECRET_ACCESS_KEY``, …), which process workers pass on to their flow runs."""
    if redact_url(cfg.storage.url) != cfg.storage.url:
        raise ValueError("storage.url carries a password: put store credentials in storage.secrets, set from the environment")
    leaked = sorted(CREDENTIAL_KEYS & _keys(cfg.storage.storage_options))
    if leaked:
        raise ValueError(f"storage.storage_options holds {', '.join(leaked)}: put store credentials in storage.secrets instead")
    env = {"DDILOCO_STORAGE__URL": cfg.storage.url, **LOGGING_ENV}
    if cfg.storage.storage_options:
        env["DDILOCO_STORAGE__STORAGE_OPTIONS"] = json.dumps(cfg.storage.storage_options, sort_keys=True)
    for var, block in (secret_blocks or {}).items():
        env[var] = "{{ prefect.blocks.secret." + block + " }}"
    return env


def read_job_template(path: Path) -> dict:
    """A base job template file (``prefect work-pool get-default-base-job-template`` format), or a one-line error."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"--base-job-template {path}: {err}") from None
    if not isinstance(data, dict) or not {"job_configuration", "variables"} <= set(data):
        raise ValueError(f"--base-job-template {path}: expected an object with job_configuration and variables")
    return data


def ensure_pool(name: str, pool_type: str = "process", base_job_template: dict | None = None) -> bool:
    """Create a work pool (``base_job_template``: e.g. infra/work-pools/kubernetes.json) unless it exists; True if created."""
    with get_client(sync_client=True) as client:
        try:
            client.create_work_pool(WorkPoolCreate(name=name, type=pool_type, base_job_template=base_job_template or {}))
        except ObjectAlreadyExists:
            return False
    return True


def deploy(
    cfg: RunConfig, *, cron: str | None = None, pool_type: str = "process", secret_blocks: dict[str, str] | None = None,
    base_job_template: dict | None = None, notify_block: str | None = None, alert_policy: AlertPolicy | None = None,
) -> DeploymentPlan:
    """One pool per region; a learner deployment per region; synchronizer, evaluator and training-run in the first region;
    the alerts' automations when a notification block (``TYPE/NAME``) is named."""
    automation_names = apply_automations(notify_block, alert_policy) if notify_block else []
    regions = [r.name for r in cfg.learners.regions]
    pools = [pool_name(r) for r in regions]
    for p in pools:
        ensure_pool(p, pool_type, base_job_template)
    names = []
    for region in regions:
        dep = learner_flow.to_deployment(
            name=f"learner-{region}",
            work_pool_name=pool_name(region),
            entrypoint_type=EntrypointType.MODULE_PATH,
            job_variables={"env": region_env(cfg, region, secret_blocks)},
            tags=["ddiloco", f"region:{region}"],
        )
        dep.apply()
        names.append(f"ddiloco-learner/learner-{region}")
    home = regions[0]
    # The synchronizer and the evaluator run in the first region's pool.
    for flow_, name, full in ((synchronizer_flow, "synchronizer", "ddiloco-synchronizer/synchronizer"),
                              (evaluate_flow, "evaluate", "ddiloco-evaluate/evaluate")):
        flow_.to_deployment(
            name=name,
            work_pool_name=pool_name(home),
            entrypoint_type=EntrypointType.MODULE_PATH,
            job_variables={"env": region_env(cfg, home, secret_blocks)},
            tags=["ddiloco"],
        ).apply()
        names.append(full)
    training_run.to_deployment(
        name="training-run",
        work_pool_name=pool_name(home),
        entrypoint_type=EntrypointType.MODULE_PATH,
        job_variables={"env": region_env(cfg, home, secret_blocks)},
        parameters={"config": cfg.model_dump(mode="json", exclude={"ledger", "storage"}), "launcher": "work-pools"},
        cron=cron,
        tags=["ddiloco"],
    ).apply()
    names.append("ddiloco-training-run/training-run")
    return DeploymentPlan(pools=pools, deployments=names, automations=automation_names)
