"""Create the work pools (one per region) and the deployments of a run against any Prefect API."""

from __future__ import annotations

from dataclasses import dataclass

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.deployments.runner import EntrypointType
from prefect.exceptions import ObjectAlreadyExists

from ddiloco.flows.training import learner_flow, synchronizer_flow, training_run
from ddiloco.platform.config import RunConfig

POOL_PREFIX = "region-"


@dataclass(frozen=True)
class DeploymentPlan:
    pools: list[str]
    deployments: list[str]


def pool_name(region: str) -> str:
    return f"{POOL_PREFIX}{region}"


def region_env(cfg: RunConfig, region: str) -> dict[str, str]:
    """What a region's worker passes to its flow runs: where its ledger and bucket are.

    Credentials are not here: they come from the worker's own environment or Prefect blocks."""
    return {"DDILOCO_LEDGER__URL": cfg.ledger.url, "DDILOCO_STORAGE__URL": cfg.storage.url}


def ensure_pool(name: str, pool_type: str = "process") -> bool:
    """Create a work pool if it does not exist; True if it was created."""
    with get_client(sync_client=True) as client:
        try:
            client.create_work_pool(WorkPoolCreate(name=name, type=pool_type))
        except ObjectAlreadyExists:
            return False
    return True


def deploy(cfg: RunConfig, *, cron: str | None = None, pool_type: str = "process") -> DeploymentPlan:
    """One pool per region; a learner deployment per region; synchronizer and training-run in the first region."""
    regions = [r.name for r in cfg.learners.regions]
    pools = [pool_name(r) for r in regions]
    for p in pools:
        ensure_pool(p, pool_type)
    names = []
    for region in regions:
        dep = learner_flow.to_deployment(
            name=f"learner-{region}",
            work_pool_name=pool_name(region),
            entrypoint_type=EntrypointType.MODULE_PATH,
            job_variables={"env": region_env(cfg, region)},
            tags=["ddiloco", f"region:{region}"],
        )
        dep.apply()
        names.append(f"ddiloco-learner/learner-{region}")
    home = regions[0]
    synchronizer_flow.to_deployment(
        name="synchronizer",
        work_pool_name=pool_name(home),
        entrypoint_type=EntrypointType.MODULE_PATH,
        job_variables={"env": region_env(cfg, home)},
        tags=["ddiloco"],
    ).apply()
    names.append("ddiloco-synchronizer/synchronizer")
    training_run.to_deployment(
        name="training-run",
        work_pool_name=pool_name(home),
        entrypoint_type=EntrypointType.MODULE_PATH,
        job_variables={"env": region_env(cfg, home)},
        parameters={"config": cfg.model_dump(mode="json", exclude={"ledger", "storage"}), "launcher": "work-pools"},
        cron=cron,
        tags=["ddiloco"],
    ).apply()
    names.append("ddiloco-training-run/training-run")
    return DeploymentPlan(pools=pools, deployments=names)
