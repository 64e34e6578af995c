"""deploy/kuberay: the RayCluster, the RayJob and the Baton manifest they carry refer to each
other consistently (names, mounts, images, ports, GPUs), and kustomization.yaml applies them all
with the one image. Static: no kubectl, no network."""

from __future__ import annotations

import posixpath
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

from deploy.manifest import Manifest, ManifestError, check_resources, load_manifest

ROOT = Path(__file__).resolve().parents[2]
KUBERAY = ROOT / "deploy" / "kuberay"
IMAGE = "ghcr.io/baton-serving/baton:0.1.0"
PLACEHOLDER = "baton"  # every container's image: kustomization.yaml says which image it is


def documents(name: str) -> dict[tuple[str, str], dict]:
    """The YAML documents of deploy/kuberay/<name>, keyed by (kind, metadata.name)."""
    docs = [d for d in yaml.safe_load_all((KUBERAY / name).read_text()) if d]
    keyed = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    assert len(keyed) == len(docs), f"{name} repeats a (kind, name)"
    return keyed


def only(docs: dict[tuple[str, str], dict], kind: str) -> dict:
    found = [d for (k, _), d in docs.items() if k == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def ray_container(pod_spec: dict) -> dict:
    """KubeRay treats the first container of a pod template as the Ray (or submitter) one."""
    return pod_spec["containers"][0]


def cpu_quantity(value: str | int | float) -> float:
    """A Kubernetes CPU quantity ("4", "500m", 2) in cores."""
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def worker_group(cluster: dict, name: str = "gpu-workers") -> dict:
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    return groups[name]


def worker_pods(cluster: dict, group: dict) -> int:
    """Pods the group can have: maxReplicas under the autoscaler, else exactly replicas."""
    assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    autoscaling = cluster["spec"].get("enableInTreeAutoscaling", False)
    return group["maxReplicas"] if autoscaling else group["replicas"]


def node_resources(group_spec: dict) -> dict[str, float]:
    """Ray resources of one pod: rayStartParams win, else KubeRay's defaults from the limits."""
    params = group_spec["rayStartParams"]
    limits = ray_container(group_spec["template"]["spec"])["resources"]["limits"]
    cpus = params.get("num-cpus", limits["cpu"])
    gpus = params.get("num-gpus", limits.get("nvidia.com/gpu", 0))
    return {"CPU": cpu_quantity(cpus), "GPU": float(gpus)}


@pytest.fixture(scope="module")
def raycluster_docs():
    return documents("raycluster.yaml")


@pytest.fixture(scope="module")
def rayjob_docs():
    return documents("rayjob.yaml")


@pytest.fixture(scope="module")
def cluster(raycluster_docs):
    return only(raycluster_docs, "RayCluster")


@pytest.fixture(scope="module")
def rayjob(rayjob_docs):
    return only(rayjob_docs, "RayJob")


@pytest.fixture(scope="module")
def submitter_pod(rayjob):
    return rayjob["spec"]["submitterPodTemplate"]["spec"]


@pytest.fixture(scope="module")
def manifest_configmap(rayjob_docs, submitter_pod) -> dict:
    """The ConfigMap that the submitter pod mounts (it must be defined in rayjob.yaml)."""
    names = [v["configMap"]["name"] for v in submitter_pod["volumes"] if "configMap" in v]
    assert names == ["baton-manifest"]
    return rayjob_docs[("ConfigMap", names[0])]


@pytest.fixture(scope="module")
def manifest(manifest_configmap, tmp_path_factory) -> Manifest:
    path = tmp_path_factory.mktemp("kuberay") / "cluster.yaml"
    path.write_text(manifest_configmap["data"]["cluster.yaml"])
    return load_manifest(path)


def test_apiversions_and_kinds(raycluster_docs, rayjob_docs):
    assert sorted(raycluster_docs) == [("RayCluster", "baton"), ("Service", "baton-grpc")]
    assert sorted(rayjob_docs) == [("ConfigMap", "baton-manifest"), ("RayJob", "baton-apply")]
    assert raycluster_docs[("RayCluster", "baton")]["apiVersion"] == "ray.io/v1"
    assert rayjob_docs[("RayJob", "baton-apply")]["apiVersion"] == "ray.io/v1"


def test_rayjob_selects_the_raycluster_and_leaves_it_running(rayjob, cluster):
    spec = rayjob["spec"]
    # KubeRay looks the cluster up by the ray.io/cluster label, whose value is the cluster name.
    assert spec["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    assert "rayClusterSpec" not in spec
    assert spec["shutdownAfterJobFinishes"] is False


def test_entrypoint_names_a_key_of_the_mounted_configmap(rayjob, submitter_pod, manifest_configmap):
    volume = next(
        v["name"]
        for v in submitter_pod["volumes"]
        if v.get("configMap", {}).get("name") == manifest_configmap["metadata"]["name"]
    )
    mounts = {m["name"]: m["mountPath"] for m in ray_container(submitter_pod)["volumeMounts"]}
    mount_path = mounts[volume]
    assert mount_path == "/etc/baton"

    # The entrypoint runs on the head, inside the working_dir that `ray job submit` uploads from
    # the submitter pod, so the working_dir must be the mount and -f is resolved against it.
    runtime_env = yaml.safe_load(rayjob["spec"]["runtimeEnvYAML"])
    assert runtime_env == {"working_dir": mount_path}
    argv = shlex.split(rayjob["spec"]["entrypoint"])
    assert argv[:3] == ["baton", "deploy", "apply"]
    manifest_arg = argv[argv.index("-f") + 1]
    assert not posixpath.isabs(manifest_arg), "an absolute -f path does not exist on the head"
    resolved = posixpath.normpath(posixpath.join(runtime_env["working_dir"], manifest_arg))
    key = posixpath.relpath(resolved, mount_path)
    assert not key.startswith(".."), f"{resolved} is outside the mount {mount_path}"
    assert key in manifest_configmap["data"]


def test_embedded_manifest_is_the_gpu_deployment(manifest):
    spec = manifest.spec
    assert (spec.model.path, spec.model.dtype) == ("smollm2-135m-instruct", "bfloat16")
    assert (spec.prefill.replicas, spec.decode.replicas) == (2, 2)
    assert spec.prefill.resources == spec.decode.resources == {"GPU": 1.0}
    assert (spec.router.host, spec.router.port) == ("0.0.0.0", 50051)
    assert spec.transfer.backend == "nccl"


def test_gpu_group_covers_the_manifest(cluster, manifest):
    group = worker_group(cluster)
    limits = ray_container(group["template"]["spec"])["resources"]["limits"]
    gpus_per_pod = int(limits["nvidia.com/gpu"])
    assert gpus_per_pod == 1
    assert int(group["rayStartParams"]["num-gpus"]) == gpus_per_pod

    pools = (manifest.spec.prefill, manifest.spec.decode)
    # A worker's bundle is placed on one node, so it must fit one pod, not just the total.
    assert all(p.resources.get("GPU", 0) <= gpus_per_pod for p in pools)
    needed = sum(p.replicas * p.resources.get("GPU", 0) for p in pools)
    assert needed == 4
    assert needed <= worker_pods(cluster, group) * gpus_per_pod


def test_head_has_no_gpus(cluster):
    head = cluster["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    assert "nvidia.com/gpu" not in ray_container(head["template"]["spec"])["resources"]["limits"]
    assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"


def test_one_image_for_head_workers_and_submitter(cluster, submitter_pod):
    spec = cluster["spec"]
    images = {
        ray_container(spec["headGroupSpec"]["template"]["spec"])["image"],
        ray_container(submitter_pod)["image"],
    }
    images |= {ray_container(g["template"]["spec"])["image"] for g in spec["workerGroupSpecs"]}
    assert images == {PLACEHOLDER}


def container_images(node) -> list[str]:
    """The image of every container and init container anywhere in a document (the paths
    kustomize's image transformer rewrites)."""
    if isinstance(node, list):
        return [image for item in node for image in container_images(item)]
    if not isinstance(node, dict):
        return []
    found = [
        c["image"]
        for key in ("containers", "initContainers")
        if isinstance(node.get(key), list)
        for c in node[key]
    ]
    return found + [image for value in node.values() for image in container_images(value)]


def test_every_manifest_takes_the_one_image_from_the_kustomization():
    kustomization = yaml.safe_load((KUBERAY / "kustomization.yaml").read_text())
    manifests = sorted(p.name for p in KUBERAY.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(kustomization["resources"]) == manifests == ["raycluster.yaml", "rayjob.yaml"]
    images = [image for name in manifests for image in container_images(documents(name))]
    assert images == [PLACEHOLDER] * 3  # head, GPU workers, the RayJob's submitter
    (entry,) = kustomization["images"]
    assert entry["name"] == PLACEHOLDER
    assert f"{entry['newName']}:{entry['newTag']}" == IMAGE
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert entry["newTag"] == version  # the image of this release


def test_router_port_is_exposed_on_the_head_and_served(raycluster_docs, cluster, manifest):
    head = ray_container(cluster["spec"]["headGroupSpec"]["template"]["spec"])
    ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert ports["grpc"] == manifest.spec.router.port

    service = raycluster_docs[("Service", "baton-grpc")]
    assert service["spec"]["selector"] == {
        "ray.io/cluster": cluster["metadata"]["name"],
        "ray.io/node-type": "head",
    }
    want = {"grpc": manifest.spec.router.port, "http": manifest.spec.router.http_port}
    assert ports["http"] == want["http"]
    served = {p["name"]: p for p in service["spec"]["ports"]}
    assert set(served) == set(want)
    for name, port in served.items():
        target = port["targetPort"]
        assert (ports[target] if isinstance(target, str) else target) == want[name]
        assert port["port"] == want[name]


def test_check_resources_passes_on_what_the_raycluster_provides(cluster, manifest):
    spec = cluster["spec"]
    total = node_resources(spec["headGroupSpec"])
    for group in spec["workerGroupSpecs"]:
        per_pod = node_resources(group)
        for name, amount in per_pod.items():
            total[name] += amount * worker_pods(cluster, group)
    assert total == {"CPU": 36.0, "GPU": 4.0}
    check_resources(manifest, total)
    # One GPU pod less and the manifest no longer fits.
    with pytest.raises(ManifestError, match="4 GPU needed for all replicas, the Ray cluster has 3"):
        check_resources(manifest, {**total, "GPU": total["GPU"] - 1})
