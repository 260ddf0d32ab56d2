"""boto3 clients with standard retries, and the translation of AWS failures into one-line fixes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import boto3
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    EndpointConnectionError,
    NoCredentialsError,
    NoRegionError,
    PartialCredentialsError,
    ProfileNotFound,
    SSOTokenLoadError,
    TokenRetrievalError,
    UnauthorizedSSOTokenError,
)

from training.sessions import new_session as new_session
from trainstack.errors import CliError

# The CLI's modules take AWS error codes from here; the one reading of them is the records' (S3's answers).
from trainstack_job.records import error_code as error_code
from trainstack_job.records import is_missing

if TYPE_CHECKING:
    from mypy_boto3_autoscaling import AutoScalingClient
    from mypy_boto3_ec2 import EC2Client
    from mypy_boto3_logs import CloudWatchLogsClient
    from mypy_boto3_pricing import PricingClient
    from mypy_boto3_s3 import S3Client
    from mypy_boto3_service_quotas import ServiceQuotasClient
    from mypy_boto3_ssm import SSMClient
    from mypy_boto3_sts import STSClient

# The Price List API answers only in a few regions; us-east-1 serves every region's prices.
PRICING_REGION = "us-east-1"
_CLIENT_CONFIG = Config(
    retries={"mode": "standard", "max_attempts": 6},
    user_agent_extra="trainstack-cli",
    # Transfers run several parts and files at once; each needs its own connection.
    max_pool_connections=32,
)
_DENIED = {
    "AccessDenied",
    "AccessDeniedException",
    "UnauthorizedOperation",
    "AuthorizationError",
    "Forbidden",
    "403",
}
_BAD_CREDENTIALS = {
    "InvalidClientTokenId",
    "SignatureDoesNotMatch",
    "InvalidAccessKeyId",
    "UnrecognizedClientException",
    "AuthFailure",
}
_EXPIRED = {"ExpiredToken", "ExpiredTokenException", "RequestExpired"}


class Clients:
    """Creates each AWS client once per command; `overrides` lets tests hand in a stubbed client."""

    def __init__(
        self,
        region: str | None,
        *,
        session: boto3.Session | None = None,
        overrides: Mapping[str, Any] | None = None,
    ) -> None:
        self.region = region
        self._session = session
        self._overrides = dict(overrides or {})
        self._made: dict[tuple[str, str | None], Any] = {}

    def with_region(self, region: str | None) -> Clients:
        """The same factory for another region (the stack's region is only known once its config is read)."""
        return Clients(region, session=self._session, overrides=self._overrides)

    def client(self, service: str, region: str | None = None) -> Any:
        if service in self._overrides:
            return self._overrides[service]
        key = (service, region or self.region)
        if key not in self._made:
            # One session per command, made on first use (it reads AWS_PROFILE then).
            if self._session is None:
                self._session = new_session()
            self._made[key] = self._session.client(  # type: ignore[call-overload]
                service, region_name=key[1], config=_CLIENT_CONFIG
            )
        return self._made[key]

    def s3(self) -> S3Client:
        return self.client("s3")

    def ec2(self) -> EC2Client:
        return self.client("ec2")

    def autoscaling(self) -> AutoScalingClient:
        return self.client("autoscaling")

    def logs(self) -> CloudWatchLogsClient:
        return self.client("logs")

    def sts(self) -> STSClient:
        return self.client("sts")

    def ssm(self) -> SSMClient:
        return self.client("ssm")

    def service_quotas(self) -> ServiceQuotasClient:
        return self.client("service-quotas")

    def pricing(self) -> PricingClient:
        return self.client("pricing", PRICING_REGION)


def is_not_found(error: ClientError) -> bool:
    """S3 answers a missing key as NoSuchKey (GET) or a bare 404 (HEAD)."""
    return is_missing(error)


def explain(error: Exception) -> CliError:
    """A botocore failure as the one line a user needs: what was refused and how to fix it."""
    if isinstance(error, NoCredentialsError | PartialCredentialsError):
        return CliError(
            "no AWS credentials found: run `aws configure` (or `aws sso login --profile NAME` and export "
            "AWS_PROFILE=NAME), then retry"
        )
    if isinstance(error, SSOTokenLoadError | UnauthorizedSSOTokenError | TokenRetrievalError):
        return CliError(f"AWS SSO session expired or missing ({error}): run `aws sso login` and retry")
    if isinstance(error, ProfileNotFound):
        return CliError(f"{error}: fix AWS_PROFILE or add the profile with `aws configure --profile NAME`")
    if isinstance(error, NoRegionError):
        return CliError(
            "no AWS region: set it with `pulumi config set aws:region us-east-1` or pass --region"
        )
    if isinstance(error, EndpointConnectionError):
        return CliError(f"cannot reach AWS ({error}): check your network, proxy and the region name")
    if isinstance(error, ClientError):
        code = error_code(error)
        message = error.response.get("Error", {}).get("Message", "") or code
        operation = error.operation_name
        if code in _DENIED:
            # S3 answers a read of a missing key AccessDenied, not NoSuchKey, to an identity that may not
            # list the bucket: the CLI reads keys that are not there yet (a job's ledger, state/...).
            missing = (
                "; S3 also answers so for a key that does not exist yet when your identity lacks "
                "s3:ListBucket on the bucket: grant that too"
                if operation in ("GetObject", "HeadObject")
                else ""
            )
            return CliError(
                f"permission denied: {operation} was refused ({message}); grant your identity that action "
                f"(see `aws sts get-caller-identity`) or use a profile that has it{missing}"
            )
        if code in _BAD_CREDENTIALS:
            return CliError(
                f"AWS rejected the credentials ({code}) on {operation}: check AWS_PROFILE / "
                "`aws configure list`, then retry"
            )
        if code in _EXPIRED:
            return CliError(
                f"AWS credentials expired ({code}): refresh them (`aws sso login` or new keys) and retry"
            )
        return CliError(f"AWS {operation} failed: {code}: {message}")
    if isinstance(error, BotoCoreError):
        return CliError(f"AWS call failed: {error}")
    return CliError(str(error))
