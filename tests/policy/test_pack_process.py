"""The pack runs the way `pulumi preview --policy-pack policypack` starts it, and answers over gRPC."""

from __future__ import annotations

import ast
import importlib.metadata
import select
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from google.protobuf import empty_pb2, struct_pb2
from pulumi.runtime.proto import analyzer_pb2, analyzer_pb2_grpc
from pulumi_policy.proxy import UNKNOWN_STRING_VALUE

from policypack.rules import POLICIES

REPO = Path(__file__).resolve().parents[2]
PACK = REPO / "policypack"


@pytest.fixture(scope="module")
def analyzer() -> Iterator[analyzer_pb2_grpc.AnalyzerStub]:
    """The pack as Pulumi's Python language host starts it: `python -m pulumi.policy <engine> <pack dir>`."""
    # The engine address is unused until a policy logs; the pack prints the port it serves on.
    process = subprocess.Popen(
        [sys.executable, "-m", "pulumi.policy", "127.0.0.1:1", str(PACK)],
        cwd=PACK,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        # Nothing read yet, so nothing buffered: select says when the port comes (readline alone would
        # wait for ever on a pack that hangs before it).
        assert select.select([process.stdout], [], [], 60)[0], "the pack printed no port within 60 s"
        port = process.stdout.readline().strip()
        assert port.isdigit(), f"the pack did not start: {process.stderr.read() if process.stderr else ''}"
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        grpc.channel_ready_future(channel).result(timeout=30)
        yield analyzer_pb2_grpc.AnalyzerStub(channel)
        channel.close()
    finally:
        process.terminate()
        process.wait(timeout=30)


def _struct(props: dict[str, Any]) -> struct_pb2.Struct:
    struct = struct_pb2.Struct()
    struct.update(props)
    return struct


def test_pack_publishes_every_policy_as_mandatory(analyzer: analyzer_pb2_grpc.AnalyzerStub) -> None:
    info = analyzer.GetAnalyzerInfo(empty_pb2.Empty())
    assert info.name == "trainstack-security-baseline"
    assert sorted(p.name for p in info.policies) == sorted(p.name for p in POLICIES)
    assert {p.enforcementLevel for p in info.policies} == {analyzer_pb2.MANDATORY}


def test_launch_template_with_imdsv1_is_a_mandatory_violation(
    analyzer: analyzer_pb2_grpc.AnalyzerStub,
) -> None:
    request = analyzer_pb2.AnalyzeRequest(
        type="aws:ec2/launchTemplate:LaunchTemplate",
        name="lt",
        urn="urn:pulumi:dev::trainstack::aws:ec2/launchTemplate:LaunchTemplate::lt",
        properties=_struct(
            {
                "metadataOptions": {"httpTokens": "optional", "httpPutResponseHopLimit": 1},
                "blockDeviceMappings": [
                    {"deviceName": "/dev/sda1", "ebs": {"encrypted": "true", "kmsKeyId": "k"}}
                ],
            }
        ),
    )
    diagnostics = analyzer.Analyze(request).diagnostics
    assert [(d.policyName, d.enforcementLevel) for d in diagnostics] == [
        ("imdsv2-required", analyzer_pb2.MANDATORY)
    ]
    assert 'set metadataOptions.httpTokens = "required"' in diagnostics[0].message


def test_unknown_values_at_preview_pass_with_an_advisory_note(
    analyzer: analyzer_pb2_grpc.AnalyzerStub,
) -> None:
    request = analyzer_pb2.AnalyzeRequest(
        type="aws:ec2/launchTemplate:LaunchTemplate",
        name="lt",
        urn="urn:pulumi:dev::trainstack::aws:ec2/launchTemplate:LaunchTemplate::lt",
        properties=_struct(
            {
                "metadataOptions": {
                    "httpTokens": "required",
                    "httpPutResponseHopLimit": UNKNOWN_STRING_VALUE,
                },
                "blockDeviceMappings": [
                    {
                        "deviceName": "/dev/sda1",
                        "ebs": {"encrypted": "true", "kmsKeyId": UNKNOWN_STRING_VALUE},
                    }
                ],
                "userData": UNKNOWN_STRING_VALUE,
            }
        ),
    )
    diagnostics = analyzer.Analyze(request).diagnostics
    assert [d for d in diagnostics if d.enforcementLevel == analyzer_pb2.MANDATORY] == []
    # Said, not hidden: each policy that could not see a value is an advisory line naming the property.
    notes = {d.policyName: d.message for d in diagnostics}
    assert set(notes) == {
        "imds-hop-limit-one",
        "ebs-encrypted-with-cmk",
        "no-secrets-in-user-data",
        "no-piped-downloads-in-user-data",
        "job-sandbox-in-user-data",
    }
    assert {d.enforcementLevel for d in diagnostics} == {analyzer_pb2.ADVISORY}
    assert (
        ".metadataOptions.httpPutResponseHopLimit can't be known during preview"
        in notes["imds-hop-limit-one"]
    )


def test_stack_policies_see_a_bucket_without_its_safeguards(analyzer: analyzer_pb2_grpc.AnalyzerStub) -> None:
    bucket = analyzer_pb2.AnalyzerResource(
        type="aws:s3/bucket:Bucket",
        name="artifacts",
        urn="urn:pulumi:dev::trainstack::aws:s3/bucket:Bucket::artifacts",
        properties=_struct({"bucket": "artifacts", "id": "artifacts"}),
    )
    diagnostics = analyzer.AnalyzeStack(analyzer_pb2.AnalyzeStackRequest(resources=[bucket])).diagnostics
    assert {d.policyName for d in diagnostics} == {
        "s3-public-access-blocked",
        "s3-tls-only",
        "s3-sse-kms",
        "s3-versioning-enabled",
        "s3-lifecycle-configured",
        "s3-access-logging",
    }
    assert all(d.urn == bucket.urn for d in diagnostics)


def test_pack_needs_only_what_its_requirements_install() -> None:
    """Pulumi runs the pack in its own virtualenv, built from requirements.txt: it may import nothing else."""
    requirements = (PACK / "requirements.txt").read_text()
    assert "pulumi-policy" in requirements and "pulumi>=" in requirements
    # PyYAML comes with the pulumi SDK (a declared requirement of it), so the pack's virtualenv has it too.
    assert any(r.lower().startswith("pyyaml") for r in importlib.metadata.requires("pulumi") or [])
    # trainstack_job: the credential shapes' one definition, read from the checkout (__main__.py puts its root
    # on the path); the pack's virtualenv can import it because it loads only the standard library (below).
    allowed = set(sys.stdlib_module_names) | {"pulumi", "pulumi_policy", "yaml", "trainstack_job"}
    for source in PACK.glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            assert {name.split(".")[0] for name in names} <= allowed, f"{source.name} imports {names}"


def test_policy_project_file_runs_python_in_the_packs_own_virtualenv() -> None:
    project = yaml.safe_load((PACK / "PulumiPolicy.yaml").read_text())
    assert project["runtime"]["name"] == "python"
    assert project["runtime"]["options"]["virtualenv"] == ".venv"


def test_what_the_pack_imports_from_trainstack_job_loads_only_the_standard_library() -> None:
    """The pack's virtualenv holds pulumi, pulumi-policy and PyYAML: trainstack_job.credentials (and the
    package it sits in) must need nothing else. -I: the repository root alone is put on the path."""
    script = (
        f"import sys; sys.path.insert(0, {str(REPO)!r}); before = set(sys.modules); "
        "import trainstack_job.credentials; print('\\n'.join(sorted(set(sys.modules) - before)))"
    )
    result = subprocess.run(
        [sys.executable, "-I", "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    loaded = {name.split(".")[0] for name in result.stdout.split()}
    assert loaded - set(sys.stdlib_module_names) == {"trainstack_job"}
