"""Fixtures for the fault-injection proxy's own tests."""

from tests.faults.fixtures import aws_via_proxy, s3_proxy

__all__ = ["aws_via_proxy", "s3_proxy"]
