"""The spec's ``code:`` section: what every node runs (an image pinned by digest, a git
commit, or an archive of a local directory)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, Self

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from .fields import (
    _COMMIT_RE,
    _DIGEST_IMAGE_RE,
    _STORE_RE,
    SECRET_STORE_HINT,
    _Model,
    _url_credentials,
    check_secret_name,
)


class ImageCode(_Model):
    """A container image pinned by digest."""

    image: str = Field(description="image reference with @sha256:<digest>")

    @field_validator("image")
    @classmethod
    def _pinned(cls, v: str) -> str:
        if not _DIGEST_IMAGE_RE.match(v):
            raise ValueError(
                "pin the image by digest (registry/repo@sha256:<64 hex>), not by tag: a "
                "backfilled node must run exactly what the others run"
            )
        return v


class GitSource(_Model):
    repo: str = Field(description="clone URL (no credentials in it: use token_secret)")
    commit: str = Field(description="the full commit hash (40 or 64 hex characters)")
    subdir: str = ""
    token_secret: str | None = Field(
        None,
        description="the cloud secret holding an HTTPS access token for a private repo, "
        "fetched at boot and given to git through GIT_ASKPASS (" + SECRET_STORE_HINT + ")",
    )
    token_user: str = Field(
        "x-access-token",
        description="the user name git sends with the token (GitHub ignores it; GitLab "
        "takes any; Bitbucket wants x-token-auth)",
    )

    @field_validator("repo")
    @classmethod
    def _not_an_option(cls, v: str) -> str:
        if v.startswith("-"):
            # git would take it for an option (--upload-pack=... runs a command). No quotes
            # in the words: an error about the clone URL hides every quotation.
            raise ValueError(
                "a clone URL cannot start with a dash (git would read it as an option): give "
                "the URL of the repository"
            )
        return v

    @field_validator("repo")
    @classmethod
    def _no_credentials(cls, v: str) -> str:
        kind = _url_credentials(v)
        if kind:
            # Never echo the URL: whatever precedes the '@' is probably a credential.
            raise ValueError(
                f"the clone URL embeds {kind} (it has '@' before the host): anyone who can "
                "describe a VM would read it in the boot script; remove it and name a secret "
                "with code.git.token_secret (" + SECRET_STORE_HINT + ")"
            )
        return v

    @field_validator("token_secret")
    @classmethod
    def _secret_name(cls, v: str | None) -> str | None:
        return None if v is None else check_secret_name(v)

    @field_validator("token_user")
    @classmethod
    def _user(cls, v: str) -> str:
        if not re.match(r"^[A-Za-z0-9._-]{1,64}\Z", v):
            raise ValueError("a git user name is letters, digits, . _ - (up to 64)")
        return v

    @model_validator(mode="after")
    def _token_over_https(self) -> Self:
        if self.token_secret and not self.repo.lower().startswith("https://"):
            raise ValueError(
                "token_secret works with an https:// clone URL only (SSH clones use the VM's "
                "SSH key)"
            )
        return self

    @field_validator("commit")
    @classmethod
    def _full_hash(cls, v: str) -> str:
        if not _COMMIT_RE.match(v):
            raise ValueError(
                "give the full commit hash (40 hex characters), not a branch, tag or short "
                "hash: a backfilled node must check out exactly what the others run"
            )
        return v


class GitCode(_Model):
    """A git repository at a commit."""

    git: GitSource


class ArchiveSource(_Model):
    path: str = Field(".", description="directory to archive, relative to the spec file")
    exclude: tuple[str, ...] = Field((), description="extra glob patterns to leave out")
    store: str | None = Field(
        None,
        description="object storage for the archive (s3://, gs://, file://); default: "
        "checkpoint.copy_to + /code",
    )

    @field_validator("store")
    @classmethod
    def _store_url(cls, v: str | None) -> str | None:
        if v is not None and not _STORE_RE.match(v):
            raise ValueError("use s3://BUCKET/PREFIX, gs://BUCKET/PREFIX or file:///DIR")
        return v


class ArchiveCode(_Model):
    """A content-addressed archive of a local directory, uploaded by ``spottrain up``."""

    archive: ArchiveSource


def _code_kind(v: Any) -> str | None:
    if isinstance(v, Mapping):
        kinds = [k for k in ("image", "git", "archive") if k in v]
        return kinds[0] if len(kinds) == 1 else None
    return next((k for k in ("image", "git", "archive") if isinstance(v, _KINDS[k])), None)


CodeSpec = Annotated[
    Annotated[ImageCode, Tag("image")]
    | Annotated[GitCode, Tag("git")]
    | Annotated[ArchiveCode, Tag("archive")],
    Discriminator(_code_kind),
]
_KINDS: dict[str, type] = {"image": ImageCode, "git": GitCode, "archive": ArchiveCode}
