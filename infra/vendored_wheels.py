"""The locked boot-time wheels (infra/wheels.py) as objects of the stack's bucket, for a stack without PyPI.

Apart from infra/wheels.py so that reading the stack config (the ops CLI's base install) needs no Pulumi SDK.
"""

from __future__ import annotations

from collections.abc import Sequence

import pulumi
import pulumi_aws as aws

from infra.wheels import WHEELS_PREFIX, VendoredWheel


class VendoredWheels(pulumi.ComponentResource):
    """The locked wheels as objects of the stack's bucket, under WHEELS_PREFIX."""

    def __init__(
        self,
        name: str,
        bucket: pulumi.Input[str],
        wheels: Sequence[VendoredWheel],
        tags: dict[str, str],
        opts: pulumi.ResourceOptions | None = None,
    ) -> None:
        super().__init__("trainstack:wheels:VendoredWheels", name, None, opts)
        keys = []
        for wheel in wheels:
            key = f"{WHEELS_PREFIX}{wheel.path.name}"
            aws.s3.BucketObjectv2(
                f"{name}-{wheel.path.name}",
                bucket=bucket,
                key=key,
                source=pulumi.FileAsset(str(wheel.path)),
                tags=tags,
                opts=pulumi.ResourceOptions(parent=self),
            )
            keys.append(key)
        self.register_outputs({"keys": keys})
