"""The GPU work pool's Kubernetes job template (deploy/kubernetes/): the Prefect API accepts it as a work pool's base
job template, and the manifest a worker would submit for a train-step run, rendered by prefect-kubernetes itself
against a real Prefect API holding the blocks, requests the GPUs and carries the image (a Prefect variable) and the
storage credentials (Secret blocks). No cluster: nothing is submitted."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
import yaml

from tests.paths import REPO

pytest.importorskip("prefect_kubernetes")
TEMPLATE = REPO / "deploy" / "kubernetes" / "gpu-base-job-template.json"


def test_gpu_job_template_renders_a_job_that_requests_gpus(prefect_api):
    from prefect.blocks.system import Secret
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.client.schemas.objects import FlowRun
    from prefect.variables import Variable
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    template = json.loads(TEMPLATE.read_text())
    Variable.set("trajflow_image", "registry.example/trajflow:gpu", overwrite=True)
    Variable.set("trajflow_storage_endpoint", "https://s3.example", overwrite=True)
    Secret(value="AKIDEXAMPLE").save("trajflow-storage-key-id", overwrite=True)
    Secret(value="not-a-real-secret").save("trajflow-storage-secret-key", overwrite=True)

    async def render():
        async with get_client() as client:
            pool = await client.create_work_pool(WorkPoolCreate(
                name=f"k8s-gpu-{uuid.uuid4().hex[:6]}", type="kubernetes", base_job_template=template))
            assert pool.base_job_template == template  # the API validated and kept it
            return await KubernetesWorkerJobConfiguration.from_template_and_values(template, {"gpus": 2},
                                                                                    client=client)

    config = asyncio.run(render())
    config.prepare_for_flow_run(FlowRun(flow_id=uuid.uuid4(), name="train-step-run"))
    job = config.job_manifest
    assert job["apiVersion"] == "batch/v1" and job["kind"] == "Job"
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 2
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert container["image"] == "registry.example/trajflow:gpu"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["AWS_ACCESS_KEY_ID"] == "AKIDEXAMPLE" and env["AWS_SECRET_ACCESS_KEY"] == "not-a-real-secret"
    assert env["AWS_ENDPOINT_URL"] == "https://s3.example" and env["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] == "30"
    assert container["args"][:3] == ["prefect", "flow-run", "execute"] and pod["restartPolicy"] == "Never"


def test_kubernetes_deployments_name_the_pools_the_readme_creates():
    spec = yaml.safe_load((REPO / "deploy" / "kubernetes" / "prefect.yaml").read_text())
    pools = {d["name"]: d["work_pool"]["name"] for d in spec["deployments"]}
    assert pools == {"k8s": "k8s-cpu", "k8s-gpu": "k8s-gpu"}
    assert [d["work_pool"]["job_variables"]["gpus"] for d in spec["deployments"]] == [0, 1]
    driver = next(d for d in spec["deployments"] if d["name"] == "k8s")
    assert driver["parameters"]["config"]["training"] == {"mode": "deployment", "deployment": "train-step/k8s-gpu"}
    readme = (REPO / "README.md").read_text()
    for command in ("prefect work-pool create k8s-gpu --type kubernetes --base-job-template "
                    "deploy/kubernetes/gpu-base-job-template.json",
                    "prefect --no-prompt deploy --all --prefect-file deploy/kubernetes/prefect.yaml"):
        assert command in readme
