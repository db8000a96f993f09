"""End to end: a run and a sweep shared through git + a DVC remote, as docs/sharing.md says (issue 49).

One pipeline run and one 3-experiment sweep in clone A (tiny_qwen2, 4 decode steps), pushed once: git to
a bare repository (the team's git server), the DVC cache to two remotes, a local folder and an S3 bucket
served on 127.0.0.1 by moto's server mode (through dvc-s3, as a team's S3 would be). Then colleagues'
clones, each a new folder with a new DVC cache:
- B pulls from the folder: `nexttoken audit` and `audit --rev <experiment>` clean, `verify` IDENTICAL,
  `diff` between two pulled experiments;
- C pulls from S3: the same bytes as A's, `audit --rev <experiment>` clean;
- D pulls from a copy of the folder remote in which one byte of the logits file's object was altered:
  `dvc pull` does not verify by default and takes it (so does it with the remote's `verify = true`: see
  the test), and `nexttoken audit` and the API's hash-checked read name the file; nothing says CLEAN.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers import shared
from tests.helpers.worktree import IDENTITY, sh, wait_for_queue

pytestmark = pytest.mark.slow
BUCKET, PREFIX = "team-runs", "nexttoken"
TEMPERATURES = (0.5, 1.0, 2.0)       # 1.0 is the baseline's: that experiment re-runs nothing
QUEUE_TIMEOUT_S = 1200
LOGITS = "artifacts/logits/logits"
# dummy credentials for the local S3; no AWS config file, no instance-metadata lookup (no traffic off loopback)
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
          "AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
          "AWS_EC2_METADATA_DISABLED": "true"}
# every command's environment: S3_ENV and, set by `team`, a DVC site cache of this module's own (the suite's shared
# one, tests/conftest.py, is removed by whichever pytest session ends first: "unable to open database file")
ENV = dict(S3_ENV)


def git(repo: Path, *args: str):
    return sh(repo, "git", *IDENTITY, *args, env=ENV)


def experiments(repo: Path) -> dict[float, str]:
    """sampling.temperature -> experiment name, from `dvc exp show` in `repo`."""
    data = json.loads(sh(repo, "dvc", "exp", "show", "--json", env=ENV).stdout)
    out = {}
    for e in (e for b in data for e in b.get("experiments") or []):
        params = e["revs"][0]["data"]["params"]["params.yaml"]["data"]
        out[params["sampling"]["temperature"]] = e["name"]
    return out


def files(root: Path) -> dict[str, str]:
    """sha256 of every file under artifacts/."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((root / "artifacts").rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def s3_endpoint():
    from moto.server import ThreadedMotoServer
    logging.getLogger("werkzeug").setLevel(logging.WARNING)      # one log line per S3 request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    assert host == "127.0.0.1"
    try:
        import boto3
        boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", aws_access_key_id="testing",
                     aws_secret_access_key="testing", region_name="us-east-1").create_bucket(Bucket=BUCKET)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.fixture(scope="module")
def team(tmp_path_factory, s3_endpoint):
    """Clone A's run and sweep, pushed to the team's git server and to both DVC remotes."""
    started, top = time.monotonic(), tmp_path_factory.mktemp("sharing")
    server, folder = top / "team.git", top / "dvc-remote"
    ENV["DVC_SITE_CACHE_DIR"] = str(top / "dvc-site")
    sh(top, "git", "init", "-q", "--bare", str(server), env=ENV)
    a = shared.baseline_clone(top / "a")      # the tiny_qwen2 run (dvc repro), committed
    # the remotes are part of the repository (committed before the sweep: an experiment's commit carries them)
    sh(a, "dvc", "remote", "add", "-d", "team", str(folder), env=ENV)
    sh(a, "dvc", "remote", "add", "team-s3", f"s3://{BUCKET}/{PREFIX}", env=ENV)
    sh(a, "dvc", "remote", "modify", "team-s3", "endpointurl", s3_endpoint, env=ENV)
    sh(a, "git", "remote", "add", "origin", str(server), env=ENV)
    assert "up to date" in sh(a, "dvc", "status", env=ENV).stdout
    git(a, "add", "-A")
    git(a, "commit", "-qm", "the team's remotes")
    try:
        sh(a, "dvc", "exp", "run", "--queue", "-S", "model=tiny_qwen2",
           "-S", "sampling.temperature=" + ",".join(map(str, TEMPERATURES)), env=ENV)
        sh(a, "dvc", "queue", "start", "-j", "2", env=ENV)
        wait_for_queue(a, QUEUE_TIMEOUT_S, poll_s=5)
    finally:
        sh(a, "dvc", "queue", "stop", "--kill", check=False, env=ENV)
    ran = time.monotonic()
    sh(a, "git", "push", "-q", "origin", "HEAD:refs/heads/main", env=ENV)
    for remote in ("team", "team-s3"):
        sh(a, "dvc", "push", "-r", remote, env=ENV)
        sh(a, "dvc", "exp", "push", "-A", "-r", remote, "origin", env=ENV)
    print(f"\nclone A: run + sweep {ran - started:.0f} s, pushes {time.monotonic() - ran:.0f} s")
    yield SimpleNamespace(a=a, server=server, folder=folder, top=top, s3=s3_endpoint, exps=experiments(a))


def colleague(team, name: str, remote: str, folder: Path | None = None) -> Path:
    """A new clone from the team's git server with its own DVC cache; the run and the experiments pulled."""
    clone = team.top / name
    sh(team.top, "git", "clone", "-q", "-b", "main", str(team.server), str(clone), env=ENV)
    assert not (clone / ".dvc/cache").exists()        # a cache of its own, filled by the pulls
    if folder is not None:                              # this colleague's copy of the remote lives elsewhere
        sh(clone, "dvc", "remote", "modify", "--local", remote, "url", str(folder), env=ENV)
    sh(clone, "dvc", "pull", "-r", remote, env=ENV)
    sh(clone, "dvc", "exp", "pull", "-A", "-r", remote, "origin", env=ENV)
    return clone


def test_the_sweep_is_three_experiments_pushed_to_the_team_with_the_remotes_in_git(team):
    assert set(team.exps) == set(TEMPERATURES), team.exps
    refs = sh(team.server, "git", "for-each-ref", "--format=%(refname)", "refs/exps", env=ENV).stdout.split()
    assert len(refs) == 3 and {r.rsplit("/", 1)[1] for r in refs} == set(team.exps.values()), refs
    folder = {p.relative_to(team.folder).as_posix() for p in team.folder.rglob("*") if p.is_file()}
    import boto3
    s3 = boto3.client("s3", endpoint_url=team.s3, aws_access_key_id="testing", aws_secret_access_key="testing",
                      region_name="us-east-1")
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=PREFIX + "/")
    bucket = {o["Key"].removeprefix(PREFIX + "/") for page in pages for o in page.get("Contents", [])}
    assert folder and bucket == folder                      # the same objects on both remotes
    config = sh(team.a, "git", "show", "HEAD:.dvc/config", env=ENV).stdout      # a colleague's clone has the remotes
    assert 'remote "team-s3"' in config and f"endpointurl = {team.s3}" in config, config
    assert "testing" not in config                           # credentials stay in the environment


def test_a_colleague_pulls_from_the_folder_remote_and_audit_verify_diff_agree(team):
    b = colleague(team, "b", "team")
    assert files(b) == files(team.a)
    assert experiments(b) == team.exps
    audit = sh(b, "nexttoken", "audit", check=False, env=ENV)
    assert audit.returncode == 0 and audit.stdout.splitlines()[-1].startswith("verdict: CLEAN"), audit.stdout
    name = team.exps[2.0]
    audit = sh(b, "nexttoken", "audit", "--rev", name, check=False, env=ENV)
    assert audit.returncode == 0, audit.stdout + audit.stderr
    assert audit.stdout.splitlines()[0].startswith(f"audit of experiment {name}"), audit.stdout
    assert audit.stdout.splitlines()[-1].startswith("verdict: CLEAN"), audit.stdout
    verify = sh(b, "nexttoken", "verify", check=False, env=ENV)
    assert verify.returncode == 0 and "verdict: IDENTICAL" in verify.stdout, verify.stdout + verify.stderr
    diff = sh(b, "nexttoken", "diff", team.exps[0.5], name, env=ENV).stdout
    assert "  config sampling.temperature: 0.5 | 2.0" in diff, diff
    assert "logits: identical logits.parquet" in diff, diff          # one forward pass, shared by the sweep


def test_a_colleague_pulls_the_same_bytes_from_the_s3_remote(team):
    c = colleague(team, "c", "team-s3")
    assert files(c) == files(team.a)
    assert experiments(c) == team.exps
    name = team.exps[0.5]
    audit = sh(c, "nexttoken", "audit", "--rev", name, check=False, env=ENV)
    assert audit.returncode == 0 and audit.stdout.splitlines()[-1].startswith("verdict: CLEAN"), audit.stdout


def _tampered_remote(team) -> tuple[Path, str]:
    """A copy of the folder remote with one byte of the baseline's logits.parquet object changed -> (its
    folder, the file's path in the workspace)."""
    logits = sorted((team.a / LOGITS).rglob("logits.parquet"))
    assert logits, f"no logits.parquet under {LOGITS}"
    rel = logits[0].relative_to(team.a).as_posix()
    md5 = hashlib.md5(logits[0].read_bytes()).hexdigest()          # DVC 3's object name: the content's md5
    copy = team.top / "dvc-remote-tampered"
    shutil.copytree(team.folder, copy)
    obj = copy / "files" / "md5" / md5[:2] / md5[2:]
    assert obj.is_file(), f"{rel}: no object {obj}"
    data = bytearray(obj.read_bytes())
    data[len(data) // 2] ^= 0x01
    obj.chmod(0o644)
    obj.write_bytes(bytes(data))
    return copy, rel


def test_a_byte_altered_in_the_remote_is_named_by_audit_and_the_api(team):
    copy, rel = _tampered_remote(team)
    d = colleague(team, "d", "team", folder=copy)       # dvc pull does not re-hash what it downloads: it succeeds
    assert files(d)[rel] != files(team.a)[rel]           # the altered bytes reached the workspace
    audit = sh(d, "nexttoken", "audit", check=False, env=ENV)
    assert audit.returncode == 1, audit.stdout + audit.stderr
    assert f"FINDING [hashes] {rel}: sha256" in audit.stdout, audit.stdout
    assert "CLEAN" not in audit.stdout.splitlines()[-1], audit.stdout
    read = sh(d, "python", "-c", "from pipeline.api import open_run; open_run('.').logits()", check=False, env=ENV)
    assert read.returncode != 0 and "ArtifactChanged" in read.stderr and rel in read.stderr, read.stderr
    status = sh(d, "dvc", "status", env=ENV)             # nor does DVC see it afterwards: its cache names the object by
    assert "up to date" in status.stdout, status.stdout     # the md5 it was asked for, not the md5 of what came
    # with the remote's `verify = true`, DVC re-hashes what it downloads: a fresh clone's pull fails, naming the
    # stage folder (not the file), and the altered file stays out of the workspace
    e = team.top / "e"
    sh(team.top, "git", "clone", "-q", "-b", "main", str(team.server), str(e), env=ENV)
    sh(e, "dvc", "remote", "modify", "--local", "team", "url", str(copy), env=ENV)
    sh(e, "dvc", "remote", "modify", "--local", "team", "verify", "true", env=ENV)
    pulled = sh(e, "dvc", "pull", "-r", "team", check=False, env=ENV)
    assert pulled.returncode == 1, pulled.stdout + pulled.stderr
    assert "Checkout failed for following targets:\nartifacts/logits\n" in pulled.stderr, pulled.stderr
    assert not (e / rel).exists()
