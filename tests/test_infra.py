"""infra/ must stay usable: the compose stack parses, the deployments ``ddiloco deploy`` makes render through the
Kubernetes template into Jobs with the resources each role needs, the images carry the extras a run needs; every
command of the README's Orchestration section is run as typed by a named test, or says why it cannot run here."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from sqlalchemy.engine import make_url

from ddiloco.platform.config import load_config
from ddiloco.testing.compose import INFRA, dotenv, render_compose
from ddiloco.testing.readme import fenced_commands, inline_commands, readme_command

ROOT = Path(__file__).resolve().parent.parent


PLANTED_ENV = {"POSTGRES_PASSWORD": "pg-planted-4c1e", "S3_ACCESS_KEY": "s3-key-planted-77", "S3_SECRET_KEY": "s3-secret-planted-9b"}


def test_compose_takes_credentials_from_env_and_gives_prefect_and_the_ledger_their_own_databases(tmp_path):
    assert set(dotenv(INFRA / ".env.example")) == set(PLANTED_ENV)
    env_file = tmp_path / ".env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in PLANTED_ENV.items()))
    compose = render_compose(env_file)
    services = compose["services"]
    assert {"postgres", "s3", "prefect-server", "worker-us", "worker-eu", "dashboard", "ledger-upgrade"} <= set(services)
    assert "--pool region-us" in services["worker-us"]["command"]
    prefect_db = make_url(services["prefect-server"]["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"])
    ledger_db = make_url(services["worker-eu"]["environment"]["DDILOCO_LEDGER__URL"])
    assert (prefect_db.host, prefect_db.port) == (ledger_db.host, ledger_db.port) and prefect_db.database != ledger_db.database
    assert f"CREATE DATABASE {prefect_db.database}" in (INFRA / "postgres-init.sql").read_text()
    secrets = set(PLANTED_ENV.values())
    assert prefect_db.password == ledger_db.password == PLANTED_ENV["POSTGRES_PASSWORD"]
    for name, service in services.items():
        command = " ".join(service.get("command") or []) if isinstance(service.get("command"), list) else service.get("command") or ""
        command += " ".join(service.get("entrypoint") or [])
        assert not [v for v in secrets if v in command], f"{name} has a credential on its command line"
    dashboard = services["dashboard"]
    assert "--address 0.0.0.0" in dashboard["command"]
    port = dashboard["command"].split("--port ")[1].split()[0]
    assert dashboard["ports"] == [f"{port}:{port}"]


def test_the_readmes_env_file_step_gives_compose_every_variable_and_stays_out_of_git(tmp_path):
    """``cp infra/.env.example infra/.env`` as typed, in a copy of infra/ (it writes infra/.env)."""
    cmd = readme_command("cp")
    shutil.copytree(INFRA, tmp_path / "infra")
    subprocess.run(cmd.argv, cwd=tmp_path, check=True)
    compose = render_compose(tmp_path / "infra" / ".env")  # a variable compose needs and .env lacks is a KeyError
    assert compose["services"]["worker-us"]["environment"]["DDILOCO_LEDGER__URL"].startswith("postgresql+psycopg://")
    assert "infra/.env" in (ROOT / ".gitignore").read_text().splitlines()  # the README says git-ignored


NEEDS_DOCKER = "not run here: needs a Docker daemon (this machine has none)"
ORCHESTRATION_COMMANDS = {
    # The start of a command the README's Orchestration section writes -> the test that runs it as typed (or how it
    # differs), or why none can.
    "cp infra/.env.example infra/.env": "test_infra.py::test_the_readmes_env_file_step_gives_compose_every_variable_and_stays_out_of_git",
    "docker compose -f infra/compose.yaml up": NEEDS_DOCKER + "; each service's command runs as a process in "
                                                               "test_prefect_integration.py::test_compose_services_come_up_on_one_postgres_in_their_own_databases",
    "docker compose -f infra/compose.yaml exec worker-us ddiloco deploy":
        "test_prefect_integration.py::test_the_readmes_three_region_deploy_in_the_worker_environment",
    "docker compose -f infra/compose.yaml exec worker-us prefect deployment run":
        "test_prefect_integration.py::test_training_run_from_the_readmes_deployment_run_on_two_region_pools",
    "prefect work-pool create": "test_prefect_integration.py::test_the_readmes_kubernetes_commands_make_the_region_pools_from_the_template",
    "ddiloco demo": "not run by the suite: the README's 3-minute demo ('Try it'); the flow it runs, a learner killed and relaunched, "
                    "is test_flows.py::test_training_run_supervises_relaunches_and_finishes",
    "ddiloco deploy": "test_prefect_integration.py::test_the_readmes_three_region_deploy_in_the_worker_environment",
    "ddiloco deploy --secret-block": "test_prefect_integration.py::test_deployments_carry_secret_names_and_the_alerts_fire",
    "ddiloco deploy --notify-block": "test_prefect_integration.py::test_deployments_carry_secret_names_and_the_alerts_fire",
    "ddiloco config": "test_secrets.py::test_config_command_masks_the_ledger_password_and_store_secrets",
    "ddiloco ledger upgrade": "test_prefect_integration.py::test_compose_services_come_up_on_one_postgres_in_their_own_databases",
    "ddiloco ledger roles": "test_ledger_roles.py::test_login_passwords_are_stored_as_scram_verifiers_only (its fixture runs these "
                            "arguments with a scratch ledger on the local PostgreSQL for db, and a prefix of its own)",
    "prefect server start": "test_prefect_integration.py::test_compose_services_come_up_on_one_postgres_in_their_own_databases",
    "prefect deployment run": "test_prefect_integration.py::test_training_run_from_the_readmes_deployment_run_on_two_region_pools",
    "prefect worker start --pool region-":
        "test_prefect_integration.py::test_training_run_from_the_readmes_deployment_run_on_two_region_pools",
    "DDILOCO_DEPLOY__GPU_IMAGE=":
        "test_prefect_integration.py::test_the_readmes_kubernetes_commands_make_the_region_pools_from_the_template",
    "docker build": NEEDS_DOCKER + " nor a registry to push to; the Jobs the images run in are "
                                   "test_infra.py::test_gpu_cluster_deployments_render_to_jobs_with_what_each_role_needs",
    "docker compose": NEEDS_DOCKER,
    "docker push": NEEDS_DOCKER + " nor a registry to push to",
}


def test_every_orchestration_command_of_the_readme_has_a_test_or_says_why_not():
    commands = [c.line for c in fenced_commands()] + inline_commands()
    used = set()
    for command in commands:
        keys = [k for k in ORCHESTRATION_COMMANDS if command.startswith(k)]
        assert keys, f"README command {command!r} has no test: run it as typed in one, and name that test here"
        used.add(max(keys, key=len))
    assert used == set(ORCHESTRATION_COMMANDS), f"no longer in the README: {set(ORCHESTRATION_COMMANDS) - used}"
    for key in used:
        where = ORCHESTRATION_COMMANDS[key]
        if where.startswith("not run"):
            continue
        path, name = where.split(" ", 1)[0].split("::")
        assert f"\ndef {name}(" in (ROOT / "tests" / path).read_text(), f"{key!r}: {where} does not exist"


def test_work_pool_templates_name_their_credentials_and_carry_no_ledger_url():
    templates = {p.stem: json.loads(p.read_text()) for p in sorted((INFRA / "work-pools").glob("*.json"))}
    assert set(templates) == {"kubernetes", "ecs", "cloud-run-v2"}
    k8s = templates["kubernetes"]
    container = k8s["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"][0]
    assert container["envFrom"] == [{"secretRef": {"name": "{{ credentials_secret }}"}}]
    # A pod asks for no GPU unless its deployment says how many (ddiloco deploy: one per learner rank).
    assert k8s["variables"]["properties"]["gpus"]["default"] == 0
    for name, template in templates.items():
        defaults = {k: v.get("default") for k, v in template["variables"]["properties"].items()}
        assert defaults["env"] == {"PREFECT_LOGGING_EXTRA_LOGGERS": "ddiloco"}, name
        assert "DDILOCO_LEDGER__URL" not in json.dumps(defaults), f"{name} carries a ledger URL"


GPU_CLUSTER = ROOT / "examples" / "gpu-cluster.yaml"
CONTROL = {"ddiloco-synchronizer/synchronizer", "ddiloco-evaluate/evaluate", "ddiloco-chaos/chaos",
           "ddiloco-training-run/training-run"}


@pytest.fixture
def gpu_cluster(monkeypatch):
    """examples/gpu-cluster.yaml with the images named as the README's deploy command names them."""
    for key in [k for k in os.environ if k.startswith("DDILOCO_")]:
        monkeypatch.delenv(key)
    env = readme_command("ddiloco", "deploy", "-c", "examples/gpu-cluster.yaml").env
    assert set(env) == {"DDILOCO_DEPLOY__GPU_IMAGE", "DDILOCO_DEPLOY__CPU_IMAGE"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return load_config(GPU_CLUSTER)


def test_gpu_cluster_deployments_render_to_jobs_with_what_each_role_needs(gpu_cluster, monkeypatch):
    """Every deployment ``ddiloco deploy`` makes for three GPU regions, rendered through infra/work-pools/kubernetes.json
    by Prefect's own templating (what a Kubernetes worker submits): learner Jobs request and limit one GPU per rank
    on their region's nodes, with their tolerations and a sized /dev/shm; the control plane asks for no GPU; every
    pod serves /metrics on the exposed port; and the GPUs a learner pod gets give each of its ranks a GPU of its own."""
    import torch

    from ddiloco.flows.deploy import plan_deployments, read_job_template, render_job
    from ddiloco.learner_worker.device import resolve_device
    from ddiloco.platform.config import build_config

    cfg = gpu_cluster
    regions = {r.name: r for r in cfg.learners.regions}
    assert len(regions) == 3 and cfg.learners.nproc_per_node == 8 and cfg.model.kind == "hf"
    template = read_job_template(INFRA / "work-pools" / "kubernetes.json")
    deployments = {spec.full_name: spec.build() for spec in plan_deployments(cfg, cron="0 2 * * *")}
    assert set(deployments) == {f"ddiloco-learner/learner-{r}" for r in regions} | CONTROL
    port = cfg.deploy.metrics_port
    for name, deployment in deployments.items():
        job = render_job(template, deployment.job_variables)
        pod = job["job_manifest"]["spec"]["template"]["spec"]
        [container] = pod["containers"]
        gpus = container["resources"]["limits"]["nvidia.com/gpu"]
        assert container["resources"]["requests"]["nvidia.com/gpu"] == gpus, name
        assert job["env"]["DDILOCO_METRICS_PORT"] == str(port), name
        assert container["ports"] == [{"name": "metrics", "containerPort": port, "protocol": "TCP"}], name
        assert container["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"}], name
        [shm] = [v["emptyDir"] for v in pod["volumes"] if v["name"] == "dshm"]
        assert shm["medium"] == "Memory", name
        if name in CONTROL:
            assert gpus == 0 and container["image"] == "registry.example.com/ml/ddiloco:cpu", name
            assert pod["nodeSelector"] == {"ddiloco.io/pool": "cpu"} and "tolerations" not in pod, name
            assert (deployment.work_pool_name, deployment.work_queue_name) == ("region-us", "control"), name
            continue
        region = regions[name.removeprefix("ddiloco-learner/learner-")]
        assert deployment.work_pool_name == f"region-{region.name}"
        assert gpus == cfg.learners.nproc_per_node and container["image"] == "registry.example.com/ml/ddiloco:cuda", name
        assert pod["nodeSelector"] == region.deploy.node_selector and len(pod["nodeSelector"]) == 1, name
        assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}], name
        assert shm["sizeLimit"] == region.deploy.shm_size == "64Gi", name
        # The pod sees its GPUs as cuda:0..gpus-1; torchrun's LOCAL_RANK of each of the learner's ranks picks one.
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda n=gpus: n)
        devices = [resolve_device(cfg.learners.device, local_rank=r) for r in range(cfg.learners.nproc_per_node)]
        assert len(set(devices)) == cfg.learners.nproc_per_node and {d.type for d in devices} == {"cuda"}, name
    nightly = deployments["ddiloco-training-run/training-run"]
    assert [s.schedule.cron for s in nightly.schedules] == ["0 2 * * *"]
    assert build_config(nightly.parameters["config"]).learners.regions == cfg.learners.regions


def test_the_default_config_deploys_one_gpu_per_learner_rank_and_a_cpu_region_on_request(monkeypatch):
    """Without deploy sections: learner pods get learners.nproc_per_node GPUs (none with device cpu), the control plane
    none, in the first region's pool; a region with gpus 0 is a CPU region on the CPU image."""
    from ddiloco.flows.deploy import plan_deployments
    from ddiloco.platform.config import build_config

    for key in [k for k in os.environ if k.startswith("DDILOCO_")]:
        monkeypatch.delenv(key)
    regions = [{"name": "a"}, {"name": "b"}, {"name": "c", "deploy": {"gpus": 0}}]
    variables = {s.full_name: (s.work_pool, s.job_variables) for s in
                 plan_deployments(build_config({"learners": {"nproc_per_node": 4, "regions": regions}}))}
    assert {n: (pool, v["gpus"], v["image"]) for n, (pool, v) in variables.items() if "learner" in n} == {
        "ddiloco-learner/learner-a": ("region-a", 4, "ddiloco:cuda"),
        "ddiloco-learner/learner-b": ("region-b", 4, "ddiloco:cuda"),
        "ddiloco-learner/learner-c": ("region-c", 0, "ddiloco:cpu"),
    }
    assert {(pool, v["gpus"], v["image"]) for n, (pool, v) in variables.items() if n in CONTROL} == {("region-a", 0, "ddiloco:cpu")}
    cpu = plan_deployments(build_config({"learners": {"nproc_per_node": 4, "device": "cpu", "regions": regions}}))
    assert {s.job_variables["gpus"] for s in cpu} == {0}


def test_images_carry_the_extras_a_run_needs_and_torch_as_pinned():
    """Both targets install the extras every shipped config needs (model.kind hf, the evaluator's TensorBoard series,
    Prefect, both stores, the PostgreSQL driver) and the torch of constraints.txt, not an older base image's."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    froms = [line.split() for line in dockerfile.splitlines() if line.startswith("FROM ")]
    assert [f[-1] for f in froms] == ["cpu", "cuda"]
    [default] = [line.split("=", 1)[1] for line in dockerfile.splitlines() if line.startswith("ARG EXTRAS=")]
    extras = set(default.split(","))
    assert extras >= {"flows", "s3", "gcs", "postgres", "hf", "tensorboard"}
    assert extras <= set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    assert dockerfile.count("ARG EXTRAS\n") == 2  # each stage takes the one default
    assert dockerfile.count("\"torch==$(sed -n 's/^torch==//p' constraints.txt)\"") == 2
    kinds = {load_config(p).model.kind for p in (ROOT / "examples").glob("*.yaml")}
    assert "hf" in kinds  # a shipped config that needs the hf extra
    compose = yaml.safe_load((INFRA / "compose.yaml").read_text())
    assert "args" not in compose["x-ddiloco-image"]["build"], "the workers' image would lack extras the Dockerfile gives"


def _other_interpreter(version: str) -> str | None:
    """A Python ``version`` interpreter on this machine (PATH, or pyenv's versions), if any."""
    found = shutil.which(f"python{version}")
    if found and subprocess.run([found, "--version"], capture_output=True).returncode == 0:
        return found
    pyenv = shutil.which("pyenv")
    if pyenv:
        root = subprocess.run([pyenv, "root"], capture_output=True, text=True).stdout.strip()
        for candidate in sorted(Path(root, "versions").glob(f"{version}.*/bin/python")):
            return str(candidate)
    return None


def test_pip_refuses_python_3_10_as_pyproject_claims(tmp_path):
    """requires-python >= 3.11 (config reads TOML with the standard library's tomllib): pip on 3.10 refuses."""
    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert spec == ">=3.11" and sys.version_info >= (3, 11)
    py310 = _other_interpreter("3.10")
    if py310 is None:
        pytest.skip("no Python 3.10 interpreter on this machine")
    src = tmp_path / "src"  # a copy: setuptools writes build/ and *.egg-info beside the sources
    shutil.copytree(ROOT / "ddiloco", src / "ddiloco", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(src)],
                   check=True, capture_output=True, cwd=tmp_path)
    out = subprocess.run([py310, "-m", "pip", "install", "--dry-run", "--no-deps", "--no-index", "--find-links", str(tmp_path), "ddiloco"],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "requires a different Python" in out.stderr, out.stderr


def test_extras_fit_the_roles_and_a_learner_runs_without_prefect_or_matplotlib():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(meta["dependencies"])
    assert "prefect" not in core and "matplotlib" not in core and "streamlit" not in core
    extras = meta["optional-dependencies"]
    assert any(d.startswith("prefect") for d in extras["flows"]) and "flows" in extras["dev"][0]
    blocked = "import sys; sys.modules.update(prefect=None, matplotlib=None, streamlit=None); "
    code = blocked + "import ddiloco.cli, ddiloco.learner_worker.launch, ddiloco.synchronizer.process, ddiloco.flows.runner"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
