"""`trainstack run` never follows a link out of the job's folder into the bundle (issue 34): a link to
~/.aws/credentials would upload the credentials with the job's code, to the bucket every instance reads."""

from __future__ import annotations

from pathlib import Path

from trainstack.run import links_outside

from .conftest import BUCKET, Deployed

JOB_FILE = """
name: tiny
command: [python, train.py]
"""


def _job(tmp_path: Path) -> tuple[Path, Path]:
    """A job folder, and a stand-in for ~/.aws/credentials outside it."""
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "train.py").write_text("print('hello')\n", encoding="utf-8")
    (folder / "job.yaml").write_text(JOB_FILE, encoding="utf-8")
    secret = tmp_path / "home" / ".aws" / "credentials"
    secret.parent.mkdir(parents=True)
    secret.write_text("[default]\naws_secret_access_key = not-for-the-bundle\n", encoding="utf-8")
    return folder, secret


def _line(link: Path, folder: Path) -> str:
    return (
        f"{link}: a link to {link.resolve()}, outside the job's folder {folder}; the bundle never follows a "
        "link out of it: replace the link with a copy of what it points to, or remove it"
    )


def test_a_link_out_of_the_job_folder_is_refused_in_one_line_and_nothing_is_uploaded(
    deployed: Deployed, tmp_path: Path
) -> None:
    folder, secret = _job(tmp_path)
    link = folder / "configs" / "aws-credentials"
    link.parent.mkdir()
    link.symlink_to(secret)
    result = deployed.run("run", str(folder / "job.yaml"), "--detach")
    assert result.code == 1
    assert result.err.splitlines() == [
        f"trainstack: error: {_line(link, folder)}",
        "trainstack: error: nothing submitted: 1 problem; fix and run again",
    ]
    listed = deployed.s3().list_objects_v2(Bucket=BUCKET).get("Contents", [])
    assert listed == [], "nothing of the job reached the bucket"


def test_links_inside_the_folder_and_in_folders_the_bundle_skips_pass(
    deployed: Deployed, tmp_path: Path
) -> None:
    folder, _ = _job(tmp_path)
    (folder / "main.py").symlink_to("train.py")  # a copy of the job's own file: bundled as one
    venv = folder / ".venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").symlink_to("/usr/bin/python3")  # never bundled, so never refused
    (folder / "output").symlink_to(tmp_path / "home")  # a run folder the bundle skips
    assert links_outside(folder) == []
    result = deployed.run("run", str(folder / "job.yaml"), "--detach", "--json")
    assert result.code == 0, result.err


def test_every_link_out_is_named_a_linked_folder_and_a_dangling_link_too(tmp_path: Path) -> None:
    folder, secret = _job(tmp_path)
    (folder / "credentials").symlink_to(secret)
    (folder / "aws").symlink_to(secret.parent, target_is_directory=True)
    (folder / "gone").symlink_to(tmp_path / "nowhere")
    (folder / "via-inside").symlink_to("credentials")  # inside, but on to the secret
    assert links_outside(folder) == [
        _line(folder / name, folder) for name in ("aws", "credentials", "gone", "via-inside")
    ]
