"""What ``status`` and ``verify`` of an ``hf://`` OUT need from the hub and this machine: the repo's manifest (one
small request), its web address, the planned files staged here but not yet in a commit (uploading or uploaded), and
the committed files checked against the hub's own checksums."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

from huggingface_hub import get_token

from resumerge.config.hubtarget import parse_hub_target
from resumerge.errors import NothingRecordedError
from resumerge.inputs.hub.cache import hub_settings
from resumerge.machine.durable import TEMP_SUFFIX
from resumerge.merge.store.hubrepo import HubRepo, check_remote, read_file
from resumerge.merge.store.manifest import MANIFEST_NAME, parse_manifest


def _repo(out: str) -> HubRepo:
    # Reading needs no write access; a public repo needs no token at all.
    return HubRepo(parse_hub_target(out), hub_settings(offline=False).endpoint, get_token() or "")


def repo_url(out: str) -> str:
    """The web address of the repo ``out`` names."""
    return _repo(out).web_url


def remote_manifest_bytes(out: str, command: str) -> tuple[bytes, str]:
    """The repo's manifest and where it was read; raises :class:`LedgerError` when the repo has none."""
    repo = _repo(out)
    data = read_file(repo, MANIFEST_NAME, resume=command, repo_needed=True)
    if data is None:
        raise NothingRecordedError(
            f"no merge recorded for {repo.target.url}: no ledger here and no {MANIFEST_NAME} in the repo",
            path=repo.target.url, hint="pass the --state-dir used by the run, or check the repo")
    return data, f"{repo.target.url}/{MANIFEST_NAME}"


def staged_names(run_dir: Path, pending: Iterable[str]) -> tuple[str, ...]:
    """The ``pending`` files with a staged copy under ``run_dir``/staging (written, not yet committed)."""
    staging = run_dir / "staging"
    if not staging.is_dir():
        return ()
    return tuple(sorted({_final_name(p.name) for p in staging.iterdir()} & set(pending)))


def _final_name(temp: str) -> str:
    """``.NAME.<12 hex>.part`` -> ``NAME`` (anything else is returned unchanged)."""
    if temp.startswith(".") and temp.endswith(TEMP_SUFFIX):
        return temp[1:-len(TEMP_SUFFIX)].rpartition(".")[0]
    return temp


def manifest_records(out: str, command: str) -> tuple[dict[str, tuple[int, str]], int]:
    """The repo manifest's committed files as ``name -> (size, sha256)``, and how many planned files are pending."""
    data, where = remote_manifest_bytes(out, command)
    manifest = parse_manifest(data, where)
    done = {k: (int(v["bytes"]), str(v["sha256"])) for k, v in manifest.committed.items()}
    return done, len(manifest.planned) - len(done)


def check_committed(out: str, records: Mapping[str, tuple[int, str]], command: str) -> dict[str, str | None]:
    """Each committed file of the repo checked against the hub's checksums (LFS: from the listing, no download)."""
    return check_remote(_repo(out), ((n, size, sha) for n, (size, sha) in records.items()), resume=command)
