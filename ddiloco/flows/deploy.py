"""Create the work pools (one per region) and the deployments of a run against any Prefect API."""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect.client.orchestration import PrefectClient, get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.deployments.runner import EntrypointType, RunnerDeployment
from prefect.exceptions import ObjectAlreadyExists
from prefect.flows import Flow
from prefect.settings import PREFECT_API_URL
from prefect.workers.base import BaseJobConfiguration
from pydantic import ConfigDict

from ddiloco.flows.alerts import AlertPolicy, apply_automations
from ddiloco.flows.training import chaos_flow, evaluate_flow, learner_flow, synchronizer_flow, training_run
from ddiloco.platform.config import PodConfig, RunConfig
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


@dataclass(frozen=True)
class DeploymentSpec:
    """One deployment as ``ddiloco deploy`` makes it: which flow, in which pool and queue, with which job variables."""

    flow: Flow
    name: str
    work_pool: str
    job_variables: dict[str, Any]
    tags: list[str]
    work_queue: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    cron: str | None = None

    @property
    def full_name(self) -> str:
        """``flow/deployment``, as ``prefect deployment run`` and ``run_deployment`` name it."""
        return f"{self.flow.name}/{self.name}"

    def build(self) -> RunnerDeployment:
        """The deployment object that ``apply()`` registers (nothing is sent before that)."""
        return self.flow.to_deployment(
            name=self.name, work_pool_name=self.work_pool, work_queue_name=self.work_queue,
            entrypoint_type=EntrypointType.MODULE_PATH, job_variables=self.job_variables, parameters=self.parameters,
            cron=self.cron, tags=self.tags,
        )


def job_variables(cfg: RunConfig, pod: PodConfig, gpus: int, env: dict[str, str]) -> dict[str, Any]:
    """The job variables of one role: infra/work-pools/kubernetes.json turns them into the pod's image, GPUs, node
    selector, tolerations, ``/dev/shm`` and metrics port; a process pool reads ``env`` and ignores the rest."""
    out: dict[str, Any] = {
        "env": env,
        "image": pod.image or (cfg.deploy.gpu_image if gpus else cfg.deploy.cpu_image),
        "gpus": gpus,
        "metrics_port": cfg.deploy.metrics_port,
    }
    if pod.node_selector:
        out["node_selector"] = dict(pod.node_selector)
    if pod.tolerations:
        out["tolerations"] = [t.model_dump(exclude_none=True) for t in pod.tolerations]
    if pod.shm_size:
        out["shm_size"] = pod.shm_size
    return out


def plan_deployments(cfg: RunConfig, *, cron: str | None = None, secret_blocks: dict[str, str] | None = None) -> list[DeploymentSpec]:
    """Every deployment of a run: a learner deployment per region (its pool, one GPU per rank), and the synchronizer,
    evaluator, training-run supervisor and chaos on the control plane (``deploy.control``: no GPU by default)."""
    specs = []
    for region in cfg.learners.regions:
        specs.append(DeploymentSpec(
            learner_flow, f"learner-{region.name}", region.deploy.work_pool or pool_name(region.name),
            job_variables(cfg, region.deploy, cfg.learners.pod_gpus(region), region_env(cfg, region.name, secret_blocks)),
            tags=["ddiloco", f"region:{region.name}"], work_queue=region.deploy.work_queue,
        ))
    control = cfg.deploy.control
    home = cfg.learners.regions[0].name
    where = {"work_pool": control.work_pool or pool_name(home), "work_queue": control.work_queue,
             "job_variables": job_variables(cfg, control, control.gpus or 0, region_env(cfg, home, secret_blocks))}
    specs += [
        DeploymentSpec(synchronizer_flow, "synchronizer", tags=["ddiloco"], **where),
        DeploymentSpec(evaluate_flow, "evaluate", tags=["ddiloco"], **where),
        DeploymentSpec(chaos_flow, "chaos", tags=["ddiloco", "chaos"], **where),
        DeploymentSpec(
            training_run, "training-run", tags=["ddiloco"], cron=cron,
            parameters={"config": cfg.model_dump(mode="json", exclude={"ledger", "storage"}), "launcher": "work-pools"}, **where,
        ),
    ]
    return specs


def deploy(
    cfg: RunConfig, *, cron: str | None = None, pool_type: str = "process", secret_blocks: dict[str, str] | None = None,
    base_job_template: dict | None = None, notify_block: str | None = None, alert_policy: AlertPolicy | None = None,
) -> DeploymentPlan:
    """Create the pools (``region-<name>`` per region unless a region names its own, and the control plane's) and
    apply :func:`plan_deployments`; the alerts' automations when a notification block (``TYPE/NAME``) is named."""
    specs = plan_deployments(cfg, cron=cron, secret_blocks=secret_blocks)
    automation_names = apply_automations(notify_block, alert_policy) if notify_block else []
    pools = list(dict.fromkeys(s.work_pool for s in specs))
    for p in pools:
        ensure_pool(p, pool_type, base_job_template)
    for spec in specs:
        spec.build().apply()
    return DeploymentPlan(pools=pools, deployments=[s.full_name for s in specs], automations=automation_names)


class _JobConfiguration(BaseJobConfiguration):
    # Every field a template's job_configuration holds (job_manifest, namespace, ...), as the worker's own class would.
    model_config = ConfigDict(extra="allow")


NO_API = "http://127.0.0.1:9/api"
"""Where :func:`render_job` sends API calls when no Prefect API is configured: nowhere (only block and variable
placeholders need one, and they should fail there)."""


def render_job(base_job_template: dict, variables: dict[str, Any]) -> dict[str, Any]:
    """The job configuration a worker of a pool with ``base_job_template`` builds for a deployment with these job
    variables, by Prefect's own merge and templating (``BaseJobConfiguration.from_template_and_values``): for a
    Kubernetes pool, ``job_manifest`` is the Job it submits and ``env`` the pod's environment."""
    client = PrefectClient(api=PREFECT_API_URL.value() or NO_API)
    config = asyncio.run(_JobConfiguration.from_template_and_values(base_job_template, variables, client=client))
    return config.model_dump()
