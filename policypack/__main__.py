"""The trainstack policy pack: `pulumi preview --policy-pack policypack` on any Pulumi AWS stack."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from pulumi_policy import EnforcementLevel, PolicyPack

# Pulumi runs this file by path with only the pack folder on sys.path. Its parent, the checkout's root, goes
# on the path too, appended so that no module of the checkout can shadow the standard library: the rules load
# as one package (relative imports), the way the tests import them as policypack, and trainstack_job's
# credential shapes (standard library only), which the job file's checks use too, are found.
_PACK_DIR = Path(__file__).resolve().parent
if __package__ in (None, ""):
    sys.path.append(str(_PACK_DIR.parent))
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
