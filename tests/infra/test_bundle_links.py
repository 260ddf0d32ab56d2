"""The bundle never follows a link out of the job's folder (issue 34): `pulumi up` and `trainstack run` both
bundle a user's job through infra.bundle.job_files, which reads each file through its links, so a link to
~/.aws/credentials would upload the credentials with the job's code, to the bucket every instance reads.
job_files refuses each such link in one line naming it, where it points and the fix; links inside the folder
are copies of the job's own files and travel as such."""

from __future__ import annotations

import gzip
import io
import tarfile
from pathlib import Path
from typing import Any

import pytest

from infra.bundle import BundleError, LinkOutsideError, build_bundle, job_files
from infra.config import StackConfigError, parse_stack_config

SECRET = "[default]\naws_secret_access_key = not-for-the-bundle\n"


def _job(tmp_path: Path) -> tuple[Path, Path]:
    """A job folder, and a stand-in for ~/.aws/credentials outside it."""
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "train.py").write_text("print('hello')\n", encoding="utf-8")
    (folder / "job.yaml").write_text("name: tiny\ncommand: [python, train.py]\n", encoding="utf-8")
    secret = tmp_path / "home" / ".aws" / "credentials"
    secret.parent.mkdir(parents=True)
    secret.write_text(SECRET, encoding="utf-8")
    return folder, secret


def _line(link: Path, folder: Path) -> str:
    return (
        f"{link}: a link to {link.resolve()}, outside the job's folder {folder}; the bundle never follows a "
        "link out of it: replace the link with a copy of what it points to, or remove it"
    )


def _archived(folder: Path) -> dict[str, bytes]:
    bundle = build_bundle(job_dir=folder)
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(bundle.data))) as tar:
        return {
            member.name: extracted.read()
            for member in tar.getmembers()
            if member.name.startswith("job/") and (extracted := tar.extractfile(member)) is not None
        }


def test_a_link_to_a_file_outside_is_refused_in_one_line_naming_it(tmp_path: Path) -> None:
    folder, secret = _job(tmp_path)
    link = folder / "configs" / "aws-credentials"
    link.parent.mkdir()
    link.symlink_to(secret)
    with pytest.raises(LinkOutsideError) as refused:
        job_files(folder)
    assert isinstance(refused.value, BundleError), "every caller that handles BundleError handles it"
    assert str(refused.value) == _line(link, folder)
    assert refused.value.problems == [_line(link, folder)]
    with pytest.raises(LinkOutsideError):
        build_bundle(job_dir=folder)  # what `pulumi up` and `trainstack run` upload


def test_every_link_out_is_named_a_linked_folder_a_dangling_link_and_one_through_an_inside_link(
    tmp_path: Path,
) -> None:
    folder, secret = _job(tmp_path)
    (folder / "credentials").symlink_to(secret)
    (folder / "aws").symlink_to(secret.parent, target_is_directory=True)
    (folder / "gone").symlink_to(tmp_path / "nowhere")
    (folder / "via-inside").symlink_to("credentials")  # inside, but on to the secret
    nested = folder / "src" / "deep"
    nested.mkdir(parents=True)
    (nested / "key").symlink_to(secret)
    with pytest.raises(LinkOutsideError) as refused:
        job_files(folder)
    expected = [
        _line(folder / name, folder) for name in ("aws", "credentials", "gone", "via-inside", "src/deep/key")
    ]
    assert refused.value.problems == expected
    assert str(refused.value) == "; ".join(expected) and "\n" not in str(refused.value)


def test_links_inside_the_folder_travel_as_copies_and_folders_the_bundle_skips_are_not_looked_at(
    tmp_path: Path,
) -> None:
    folder, _ = _job(tmp_path)
    (folder / "main.py").symlink_to("train.py")
    (folder / "lib").mkdir()
    (folder / "lib" / "train.py").symlink_to("../train.py")
    venv = folder / ".venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").symlink_to("/usr/bin/python3")
    (folder / "output").symlink_to(tmp_path / "home")
    (folder / "checkpoints").mkdir()
    (folder / "checkpoints" / "secret").symlink_to(tmp_path / "home" / ".aws" / "credentials")
    names = sorted(name for name, _ in job_files(folder))
    assert names == ["job/job.yaml", "job/lib/train.py", "job/main.py", "job/train.py"]
    archived = _archived(folder)
    assert archived["job/main.py"] == archived["job/lib/train.py"] == b"print('hello')\n"
    assert not any(SECRET.encode() in content for content in archived.values())


def test_pulumi_preview_names_the_link_in_one_problem_line(tmp_path: Path) -> None:
    folder, secret = _job(tmp_path)
    link = folder / "credentials"
    link.symlink_to(secret)
    raw: dict[str, Any] = {"job": str(folder / "job.yaml")}
    with pytest.raises(StackConfigError) as refused:
        parse_stack_config(raw, region="us-east-1", project="trainstack", stack="dev")
    problems = [line for line in str(refused.value).splitlines() if line.startswith("  - ")]
    assert problems == [f"  - {_line(link, folder.resolve())}"]
