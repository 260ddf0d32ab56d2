"""What looks like a credential (trainstack_job/credentials.py): the one definition of the secret shapes and
of the names that say a value is one, read by the job file's `env:` check, the built-in trainer config's
check and the policy pack's user-data scan. Each shape is found and named, a value alone (40 hex digits, 40
mixed base64 characters) is judged by its name, and a refusal names the key and the fix, never the value.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from trainstack_job.credentials import (
    CREDENTIAL_PATTERNS,
    CREDENTIAL_WORDS,
    credential_kinds,
    env_secret_problem,
    find_secret_values,
    secret_name,
    secret_value_kind,
)
from trainstack_job.secret_refs import SET_COMMAND

# The checkout's docs: the nearest folder up that has them (mutmut runs the tests from a folder of its copy).
DOCS_ROOT = next(p for p in Path(__file__).resolve().parents if (p / "docs" / "job-contract.md").is_file())
HF_TOKEN = "hf_" + "Ab1" * 11 + "x"
WANDB = "0123456789abcdef" * 2 + "01234567"  # 40 hex digits: a W&B key
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"  # 40 mixed base64 characters
W_AND_B = "a W&B API key (40 hex digits)"
BASE64 = "an AWS secret access key (40 base64 characters)"

# One example of each shape, mixed case where the shape allows it, in CREDENTIAL_PATTERNS' order.
SHAPES = [
    ("an AWS access key ID", "AKIAIOSFODNN7EXAMPLE"),
    ("an AWS secret access key", f'aws_secret_access_key = "{AWS_SECRET}"'),
    ("a private key", "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaA==\n-----END OPENSSH PRIVATE KEY-----"),
    ("a GitHub token", "ghp_" + "a1B2" * 9),
    ("a Slack token", "xoxb-AbCdEfGhIjKl-1234"),
    ("credentials in a URL", "https://alice:s3cr3t@example.com/repo.git"),
    ("a password", "password: hunter22"),
    ("a Hugging Face token", HF_TOKEN),
    ("a .netrc password", "machine api.wandb.ai\n  login me\n  password s3cr3tpass"),
]


# --- the shapes ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "text"), SHAPES)
def test_each_credential_shape_is_found_and_named_by_its_kind(kind: str, text: str) -> None:
    """A value of each shape is found, and named as what it is (the name the refusal shows the user)."""
    assert credential_kinds(f"some text around it: {text}\nand after") == [kind]
    assert secret_value_kind(text) == kind


def test_a_text_holding_every_shape_names_them_all_in_the_patterns_order() -> None:
    """Every kind a text holds is named, in CREDENTIAL_PATTERNS' order; a value is named by the first."""
    text = "\n".join(example for _, example in reversed(SHAPES))
    assert credential_kinds(text) == [kind for kind, _ in SHAPES] == [kind for kind, _ in CREDENTIAL_PATTERNS]
    assert secret_value_kind(f"{HF_TOKEN} {SHAPES[0][1]}") == SHAPES[0][0]


@pytest.mark.parametrize("prefix", ["AKIA", "ASIA", "ABIA", "ACCA", "A3TX"])
def test_every_aws_access_key_prefix_is_a_key_id(prefix: str) -> None:
    """Long-term, temporary and service key IDs alike: every AWS key prefix."""
    assert credential_kinds(prefix + "IOSFODNN7EXAMPLE") == ["an AWS access key ID"]


@pytest.mark.parametrize(
    "text",
    [
        "AKIAIOSFODNN7EXAMPL",  # one character short
        "password: $DB_PASSWORD",  # a reference, not a password
        "password: <your-password>",
        "password: short",  # under six characters
        "https://alice:${PASS}@example.com/",
        "https://example.com/a:b@c",
        "machine api.wandb.ai login me password $NETRC_PASSWORD",
        "xoxb-short",
        "hf_tooshort",
        "-----BEGIN PUBLIC KEY-----",
    ],
)
def test_a_reference_a_placeholder_or_a_near_miss_is_no_credential(text: str) -> None:
    """What only resembles a credential (a $VAR, a <placeholder>, a shape cut short) is none."""
    assert credential_kinds(text) == []


# --- a value alone ------------------------------------------------------------------------------------------


def test_forty_hex_digits_are_a_wandb_key_unless_more_hex_surrounds_them() -> None:
    """40 hex digits on their own are a W&B key; 41 or more (upper or lower case around them) are not 40."""
    assert secret_value_kind(WANDB) == W_AND_B
    assert secret_value_kind(f"key={WANDB};") == W_AND_B
    for longer in (f"F{WANDB}", f"{WANDB}F", f"f{WANDB}", f"{WANDB}0"):
        assert secret_value_kind(longer) is None, longer


@pytest.mark.parametrize(
    "name", ["GIT_SHA", "SHA1", "GIT_COMMIT", "REV", "base_revision", "HASH", "DIGEST", "REF"]
)
def test_forty_hex_digits_named_as_a_commit_or_a_digest_are_no_credential(name: str) -> None:
    """A name that says commit, revision, hash or digest makes 40 hex digits what it says, in any case."""
    assert secret_value_kind(WANDB, name) is None
    assert env_secret_problem("job.yaml: env", name, WANDB) is None
    # The name's word, not the value, decides: the same value under another name is a key.
    assert secret_value_kind(WANDB, f"{name}X") == W_AND_B


def test_forty_mixed_base64_characters_are_an_aws_secret_key_only_with_upper_lower_and_digits() -> None:
    """A 40-character base64 token is a secret key when it mixes upper case, lower case and digits."""
    assert secret_value_kind(AWS_SECRET) == BASE64
    letters = "wJalrXUtnFEMIKMDENGbPxRfiCYEXAMPLEKEYab"  # 39 letters, no digit
    assert len(AWS_SECRET) == 40 and len(letters) == 39
    assert secret_value_kind(letters + "c") is None  # no digit
    assert secret_value_kind(AWS_SECRET.lower().replace("/", "z")) is None  # no upper case
    assert secret_value_kind(AWS_SECRET.upper().replace("/", "Z")) is None  # no lower case
    # One token that is not a key does not hide a later one that is.
    assert secret_value_kind(f"{letters}c {AWS_SECRET}") == BASE64
    # 41 characters are not 40.
    assert secret_value_kind(AWS_SECRET + "x") is None


# --- names --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    ["HF_TOKEN", "CLIENT_SECRET", "APP_SECRETS", "DB_PASSWORD", "SMTP_PASSWD", "GPG_PASSPHRASE", "SVC_APIKEY",
     "GCP_CREDENTIAL", "GOOGLE_CREDENTIALS", "hf_token"],
)  # fmt: skip
def test_a_name_with_a_credential_word_as_one_segment_says_it_holds_a_credential(name: str) -> None:
    """A credential word as a whole `_` segment, in any case, marks a name (as the policy pack reads it)."""
    assert secret_name(name)
    assert CREDENTIAL_WORDS.intersection(name.upper().split("_"))


@pytest.mark.parametrize(
    "name", ["WANDB_API_KEY", "SSH_KEY", "aws_secret_key", "DBPASSWORD", "aws_access_key_id"]
)
def test_any_key_name_a_password_anywhere_and_the_aws_key_id_say_a_credential(name: str) -> None:
    """`*_KEY`, PASSWORD inside a word, and AWS_ACCESS_KEY_ID (which ends in ID) each mark a name."""
    assert secret_name(name)


@pytest.mark.parametrize(
    "name",
    ["TOKENIZERS_PARALLELISM", "MAX_NEW_TOKENS", "KEY_PATH", "KEYBOARD", "SECRETARY_NAME",
     "DATA_DIR", "AWS_ACCESS_KEY_ID_FILE"],
)  # fmt: skip
def test_a_name_that_only_contains_a_word_is_no_credential(name: str) -> None:
    """A word inside a longer segment, or KEY anywhere but last, marks nothing."""
    assert not secret_name(name)


# --- the refusal ------------------------------------------------------------------------------------------


def _docs_named(line: str) -> None:
    """The line ends naming a section of the docs that exists."""
    named = re.search(r"\((docs/[^,]+), (\w+)\)$", line)
    assert named is not None, line
    assert f"## {named[2]}" in (DOCS_ROOT / named[1]).read_text().splitlines()


def test_a_secret_looking_value_is_refused_naming_its_kind_and_the_fix_never_the_value() -> None:
    """The one line names where, the kind, the command and the docs, and never repeats the value."""
    line = env_secret_problem("job.yaml: env", "SOME_SETTING", HF_TOKEN)
    assert line is not None
    assert line.startswith("job.yaml: env.SOME_SETTING: its value looks like a Hugging Face token, ")
    assert f"`{SET_COMMAND} NAME`" in line and "secrets: {SOME_SETTING: NAME}" in line
    assert HF_TOKEN not in line and "\n" not in line
    _docs_named(line)


@pytest.mark.parametrize("value", ["plain-looking", "s3cr3t"])
def test_a_secret_name_with_any_non_plain_value_is_refused(value: str) -> None:
    """A credential's name refuses its value even when the value looks like nothing."""
    line = env_secret_problem("job.yaml: env", "HF_TOKEN", value)
    assert line is not None
    assert line.startswith("job.yaml: env.HF_TOKEN: its name says it holds a credential, ")
    assert value not in line
    _docs_named(line)


@pytest.mark.parametrize(
    "value",
    ["", "  ", "true", "False", "yes", " no ", "On", "off", "null", "None", "512", " 1e-4 ", "-3",
     4096, 0.5, True, False],
)  # fmt: skip
def test_a_secret_name_with_an_empty_boolean_or_numeric_value_passes(value: Any) -> None:
    """No credential is empty, a boolean or a number (a string saying one included), whatever the name."""
    assert env_secret_problem("job.yaml: env", "HF_TOKEN", value) is None


def test_an_ordinary_name_and_value_pass_and_a_non_string_value_is_judged_by_its_name() -> None:
    """A setting's plain value passes; a number never looks like a credential's value."""
    assert env_secret_problem("job.yaml: env", "WANDB_MODE", "offline") is None
    assert env_secret_problem("job.yaml: env", "BATCH_SIZE", 10**39) is None


# --- a parsed config ----------------------------------------------------------------------------------------


def test_each_credential_in_a_config_is_found_by_its_dotted_key_never_its_value() -> None:
    """Dicts and lists at any depth: each string that looks like a credential, by its path."""
    tree = {
        "train": {"lr": 0.1, "steps": 10},
        "logging": {"wandb_key": WANDB, "tags": ["ok", HF_TOKEN]},
        "hub": HF_TOKEN,
        7: {"url": "https://alice:s3cr3t@example.com/x"},
    }
    found = find_secret_values(tree, "cfg.yaml")
    assert [line.split(": looks like ")[0] for line in found] == [
        "cfg.yaml: logging.wandb_key",
        "cfg.yaml: logging.tags[1]",
        "cfg.yaml: hub",
        "cfg.yaml: 7.url",
    ]
    assert [line.split(": looks like ")[1].split(";")[0] for line in found] == [
        W_AND_B,
        "a Hugging Face token",
        "a Hugging Face token",
        "credentials in a URL",
    ]
    for line in found:
        assert f"`{SET_COMMAND} NAME`" in line
        assert WANDB not in line and HF_TOKEN not in line and "s3cr3t" not in line


def test_a_config_list_at_the_top_is_found_by_its_index() -> None:
    """A config that is a list names each finding by its index alone."""
    assert [line.split(": looks like ")[0] for line in find_secret_values([1, HF_TOKEN], "cfg.yaml")] == [
        "cfg.yaml: [1]"
    ]


def test_in_a_config_the_last_key_alone_says_commit_or_digest() -> None:
    """40 hex digits under a key that names a commit pass at any depth; the key, not its parents, decides."""
    tree = {"build": {"git": {"sha": WANDB, "ref": WANDB}}, "sha": {"wandb": WANDB}}
    assert find_secret_values({"commit": WANDB}, "cfg.yaml") == []
    found = find_secret_values(tree, "cfg.yaml")
    assert [line.split(": looks like ")[0] for line in found] == ["cfg.yaml: sha.wandb"]
