"""The pack's user-data scan reads a cloud-config as parsed YAML (issue 24): a Hugging Face token, a W&B key,
a .netrc password and an AWS secret key are found even when YAML folds or escapes the line that holds them,
where a scan of the raw text sees only fragments. Only `no-secrets-in-user-data` runs here."""

from __future__ import annotations

import base64

import pytest

from policypack.rules import POLICIES
from policypack.user_data import find_secrets, scan_user_data
from tests.policy.golden import compliant_stack, named
from tests.policy.harness import check

SCAN = [policy for policy in POLICIES if policy.name == "no-secrets-in-user-data"]
HF = "hf_" + "Ab1" * 11 + "x"
WANDB = "0123456789abcdef" * 2 + "01234567"

# Each value broken by a YAML double-quoted line continuation (`\` at the end of a line): the parsed string is
# whole, the raw text never holds it on one line.
FOLDED = {
    "hf-token-in-job-env": (
        "#cloud-config\nwrite_files:\n  - path: /etc/trainstack/agent.yaml\n    content: |\n"
        "      user_job:\n        env:\n"
        f'          HF_TOKEN: "{HF[:10]}\\\n            {HF[10:]}"\n',
        "a Hugging Face token",
    ),
    "wandb-key-in-a-script": (
        "#cloud-config\nruncmd:\n"
        f'  - "export WANDB_API_KEY={WANDB[:20]}\\\n    {WANDB[20:]}; python train.py"\n',
        "a credential in WANDB_API_KEY",
    ),
    "netrc-password": (
        "#cloud-config\nwrite_files:\n  - path: /root/.netrc\n"
        '    content: "machine api.wandb.ai login user pass\\\n      word s3cr3t-passw0rd\\n"\n',
        "a .netrc password",
    ),
    "aws-secret-key-in-credentials": (
        "#cloud-config\nwrite_files:\n  - path: /root/.aws/credentials\n"
        '    content: "[default]\\naws_secret_access_key = wJalrXUtnFEMI/K7MDENG\\\n'
        '      /bPxRfiCYEXAMPLEKEY\\n"\n',
        "an AWS secret access key",
    ),
}


@pytest.mark.parametrize("case", FOLDED)
def test_a_folded_secret_is_found_in_the_parsed_values_where_the_raw_text_misses_it(case: str) -> None:
    text, kind = FOLDED[case]
    assert kind not in find_secrets(text), "the raw text alone should not show it"
    assert kind in scan_user_data(text, text)
    resources = compliant_stack()
    named(resources, "launch-template").props["userData"] = base64.b64encode(text.encode()).decode()
    violations = check(resources, policies=SCAN)
    assert any(
        f"userData contains {kind}: read it at boot from SSM Parameter Store" in v.message for v in violations
    )
    assert all("`secrets:` in job.yaml, `trainstack secrets set NAME`" in v.message for v in violations)


@pytest.mark.parametrize(
    "text",
    [
        # Gzipped write_files content, base64-encoded, holding a dotenv file.
        "#cloud-config\nwrite_files:\n  - path: /etc/job.env\n    encoding: gz+b64\n    content: "
        + base64.b64encode(__import__("gzip").compress(f"HF_TOKEN={HF}\n".encode())).decode()
        + "\n",
        f"#cloud-config\nbootcmd:\n  - [sh, -c, 'echo {HF} > /root/.cache/huggingface/token']\n",
        "#!/bin/sh\nexport HF_TOKEN='plain-literal-token'\n",
        "#cloud-config\nwrite_files:\n  - path: /etc/trainstack/agent.yaml\n    content: |\n"
        "      user_job:\n        env: {HF_TOKEN: plain-literal-token}\n",
    ],
)
def test_tokens_in_encoded_files_commands_and_scripts_are_found(text: str) -> None:
    assert scan_user_data(text, text)


@pytest.mark.parametrize(
    "text",
    [
        # A job's secrets by reference: names, not values.
        "#cloud-config\nwrite_files:\n  - path: /etc/trainstack/agent.yaml\n    content: |\n"
        "      user_job:\n        secrets: {HF_TOKEN: hf-token, WANDB_API_KEY: 'secretsmanager:wandb'}\n"
        "      bundle_key: code/0123.tar.gz\n",
        "#!/bin/sh\nHF_TOKEN=$(aws ssm get-parameter --name /trainstack/dev/hf-token --with-decryption)\n",
        "#!/bin/sh\nTOKEN=$(curl -X PUT http://169.254.169.254/latest/api/token)\n",
        "#cloud-config\nssh_pwauth: false\nwrite_files:\n  - {path: /etc/x, content: 'API_KEY=${API_KEY}'}\n",
    ],
)
def test_references_and_ordinary_settings_are_not_secrets(text: str) -> None:
    assert scan_user_data(text, text) == []


def test_the_compliant_stack_has_no_secret_in_its_user_data() -> None:
    assert check(compliant_stack(), policies=SCAN) == []
