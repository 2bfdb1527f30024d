"""deploy/: every YAML parses, the Ray launcher config passes Ray's own schema, and every
`pdserve` command line in a manifest, the Dockerfile or the README parses with the real CLI
(so a renamed or removed flag breaks this test, not a deployment)."""

from __future__ import annotations

import glob
import json
import os
import re
import shlex

import pytest
import yaml

from pdserve.launcher.cli import build_parser

DEPLOY = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "deploy")
SUBCOMMANDS = ("up", "worker", "router", "generate")


def yaml_files() -> list[str]:
    return sorted(glob.glob(os.path.join(DEPLOY, "**", "*.yaml"), recursive=True))


def load_all(path: str) -> list:
    with open(path) as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def command_lines(node) -> list[list[str]]:
    """argv lists (without the leading `pdserve`) found in a parsed manifest."""
    found: list[list[str]] = []
    if isinstance(node, dict):
        if "image" in node and ("args" in node or "command" in node):  # a container; ENTRYPOINT is pdserve
            argv = [str(a) for a in (node.get("command") or []) + (node.get("args") or [])]
            if argv and argv[0] == "pdserve":
                argv = argv[1:]
            if argv and argv[0] in SUBCOMMANDS:
                found.append(argv)
        for value in node.values():
            found += command_lines(value)
    elif isinstance(node, list):
        for value in node:
            found += command_lines(value)
    elif isinstance(node, str) and re.search(r"\bpdserve (up|worker|router)\b", node):
        found += shell_commands(node)
    return found


def shell_commands(text: str) -> list[list[str]]:
    """`pdserve <sub> ...` commands inside shell text (quotes respected, stops at ; && | or newline);
    mentions in prose (`pdserve up`, in backticks) are not commands."""
    out = []
    for match in re.finditer(r"(?<![`\w])pdserve ((?:up|worker|router)\b[^;&|\n`]*)", text.replace("\\\n", " ")):
        out.append(shlex.split(match.group(1)))
    return out


def check_parses(argv: list[str]) -> None:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"`pdserve {' '.join(argv)}` does not parse (exit {e.code})")
    assert args.command == argv[0]


@pytest.mark.parametrize("path", yaml_files(), ids=os.path.basename)
def test_yaml_parses_and_commands_are_valid(path):
    docs = load_all(path)
    assert docs, f"{path} is empty"
    for doc in docs:
        assert isinstance(doc, dict)
        for argv in command_lines(doc):
            check_parses(argv)


def test_every_manifest_runs_pdserve():
    commands = {os.path.relpath(p, DEPLOY): [argv for d in load_all(p) for argv in command_lines(d)]
                for p in yaml_files()}
    assert [a[0] for a in commands["kuberay/rayjob.yaml"]] == ["up"]
    assert "--address" in commands["kuberay/rayjob.yaml"][0]
    assert sorted(a[0] for a in commands["k8s/workers.yaml"]) == ["worker", "worker"]
    assert [a[0] for a in commands["k8s/router.yaml"]] == ["router"]


def test_kuberay_resources_match_the_pinning_flags():
    cluster = next(d for d in load_all(os.path.join(DEPLOY, "kuberay", "raycluster.yaml")) if d["kind"] == "RayCluster")
    advertised = set()
    for group in cluster["spec"]["workerGroupSpecs"]:
        # KubeRay's documented form: a JSON string inside a quoted string
        advertised |= set(json.loads(json.loads(group["rayStartParams"]["resources"])))
    (job,) = load_all(os.path.join(DEPLOY, "kuberay", "rayjob.yaml"))
    assert job["spec"]["clusterSelector"]["ray.io/cluster"] == cluster["metadata"]["name"]
    (argv,) = shell_commands(job["spec"]["entrypoint"])
    args = build_parser().parse_args(argv)
    assert set(args.prefill_resources) | set(args.decode_resources) == advertised


def test_k8s_router_points_at_the_worker_statefulsets():
    workers = {d["metadata"]["name"]: d for d in load_all(os.path.join(DEPLOY, "k8s", "workers.yaml"))
               if d["kind"] == "StatefulSet"}
    (argv,) = [a for d in load_all(os.path.join(DEPLOY, "k8s", "router.yaml")) for a in command_lines(d)]
    args = build_parser().parse_args(argv)
    for entry in args.worker:
        role, address = entry.split("=")
        host, port = address.rsplit(":", 1)
        pod, service = host.split(".")[:2]
        assert service in workers and pod == f"{service}-0" and port == "50051"
        assert role in service


def test_ray_cluster_launcher_config_matches_rays_schema():
    jsonschema = pytest.importorskip("jsonschema")
    ray_autoscaler = pytest.importorskip("ray.autoscaler")
    with open(os.path.join(os.path.dirname(ray_autoscaler.__file__), "ray-schema.json")) as f:
        schema = json.load(f)
    (config,) = load_all(os.path.join(DEPLOY, "ray-cluster.yaml"))
    jsonschema.validate(config, schema)
    for line in config["head_start_ray_commands"] + config["worker_start_ray_commands"]:
        assert isinstance(line, str)
    with open(os.path.join(DEPLOY, "ray-cluster.yaml")) as f:
        for argv in shell_commands(f.read().replace("#", " ")):
            check_parses(argv)


def test_dockerfile_cmd_and_readme_commands_parse():
    with open(os.path.join(DEPLOY, "Dockerfile")) as f:
        dockerfile = f.read()
    assert re.search(r'^ENTRYPOINT \["pdserve"\]$', dockerfile, re.M)
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", dockerfile, re.M).group(1))
    check_parses(cmd)
    for variant in ("base-cpu", "base-cuda"):
        assert f"AS {variant}" in dockerfile
    with open(os.path.join(DEPLOY, "README.md")) as f:
        readme = f.read()
    commands = shell_commands(readme)
    assert sorted(argv[0] for argv in commands) == ["router", "up", "worker"]
    for argv in commands:
        check_parses(argv)


def test_readme_config_file_example_is_valid(tmp_path):
    from pdserve.launcher.cluster.config import load_up_config

    with open(os.path.join(DEPLOY, "README.md")) as f:
        (block,) = re.findall(r"```yaml\n(.*?)```", f.read(), re.S)
    path = tmp_path / "cluster.yaml"
    path.write_text(block)
    config = load_up_config({}, str(path))
    assert config.address == "auto" and config.pool_resources("decode") == {"decode_node": 1.0}
