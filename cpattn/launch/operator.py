"""The operator credential of a service `cpattn serve` started: printed once, kept in a private file.

`cpattn stop` and `cpattn status` (admin stats) need it. They take it from ``--operator-credential``, else
``CPATTN_OPERATOR_CREDENTIAL``, else the file serve wrote on this machine:
``~/.cpattn/operators/<Ray GCS address>/<namespace>/<name>`` (directories 0700, the file 0600, in the
user's home: nothing shared with other users). The service itself keeps only its SHA-256.
"""

from __future__ import annotations

import os
from pathlib import Path

from cpattn.errors import AccessDeniedError

ENV = "CPATTN_OPERATOR_CREDENTIAL"


def credential_path(gcs_address: str, namespace: str, name: str) -> Path:
    safe = [part.replace(os.sep, "_").replace(":", "_") for part in (gcs_address, namespace, name)]
    return Path.home() / ".cpattn" / "operators" / safe[0] / safe[1] / safe[2]


def save(path: Path, credential: str) -> None:
    for parent in reversed([p for p in path.parents if p >= Path.home() / ".cpattn"]):
        parent.mkdir(mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)   # an existing file keeps its mode through O_CREAT: set it
        os.write(fd, credential.encode())
    finally:
        os.close(fd)


def find(given: str | None, path: Path, command: str) -> str:
    """The flag's value, else the environment's, else the file's; AccessDeniedError naming all three."""
    if given:
        return given
    if os.environ.get(ENV):
        return os.environ[ENV]
    try:
        return path.read_text().strip()
    except OSError:
        raise AccessDeniedError(f"`cpattn {command}` needs the service's operator credential (printed by `cpattn "
                                f"serve`): pass --operator-credential, set {ENV}, or run it where serve wrote "
                                f"{path}") from None


def forget(path: Path) -> None:
    """Remove the credential file, and its service's directories once empty (up to ~/.cpattn/operators)."""
    try:
        path.unlink()
    except OSError:
        pass
    top = Path.home() / ".cpattn" / "operators"
    for parent in path.parents:
        if parent == top or top not in parent.parents:
            break
        try:
            parent.rmdir()   # only an empty one
        except OSError:
            break
