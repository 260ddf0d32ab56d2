"""The trainstack policy pack: `pulumi preview --policy-pack infra/policy` on any Pulumi AWS stack."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from pulumi_policy import EnforcementLevel, PolicyPack

# Pulumi runs this file by path with only the pack folder on sys.path. Its parent goes on the path too,
# appended so no infra/ module can shadow the standard library, and the rules load as one package
# (relative imports), the way the tests import them as infra.policy. So does the checkout's root, for
# trainstack_job.credentials (standard library only): the credential shapes the job file's checks use too.
_PACK_DIR = Path(__file__).resolve().parent
if __package__ in (None, ""):
    sys.path.append(str(_PACK_DIR.parent))
    sys.path.append(str(_PACK_DIR.parent.parent))
    rules = importlib.import_module(f"{_PACK_DIR.name}.rules")
else:
    rules = importlib.import_module(f"{__package__}.rules")

PolicyPack(
    name="trainstack-security-baseline",
    policies=rules.POLICIES,
    enforcement_level=EnforcementLevel.MANDATORY,
    description="AWS FSBP / CIS controls for spot-GPU training stacks; each policy names its control IDs.",
    provider="aws",
    tags=["aws", "fsbp", "cis", "security"],
)
