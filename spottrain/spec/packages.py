"""The spec's ``packages:`` section: where the VMs' pip finds third-party packages, and the
Python it installs them for.

spottrain itself never comes from an index: the run ships its own wheel (see
``controller/run/wheel.py``). Everything else (torch, boto3, the job's requirements) comes
from PyPI, or from the mirror named here. Credentials never appear in a URL here nor in a
boot script: ``credentials_secret`` names a cloud secret holding ``USER:PASSWORD`` (or a bare
token), which the VM reads at boot into a root-only pip configuration file.
"""

from __future__ import annotations

import re
from typing import Self

from pydantic import Field, field_validator, model_validator

from .fields import SECRET_STORE_HINT, _Model, _url_credentials, check_secret_name

DEFAULT_PYTHON = "3.11"
_PYTHON_RE = re.compile(r"^3\.(1[1-9]|[2-9][0-9])\Z")


def _index_url(v: str, what: str) -> str:
    if not re.match(r"^https?://[^\s/]+(/\S*)?\Z", v):
        raise ValueError(
            f"{what} {v!r} is not an http(s) URL the VMs can reach (a path on this machine "
            "is not on the VMs: serve the folder, or publish the wheels to an index)"
        )
    kind = _url_credentials(v)
    if kind:
        # Never echo the URL: the part before '@' is probably a credential.
        raise ValueError(
            f"{what}: the URL embeds {kind} (it has '@' before the host), which would travel "
            "in every VM's boot script: remove it and name a secret with "
            "packages.credentials_secret (" + SECRET_STORE_HINT + ")"
        )
    return v.rstrip("/")


class PackagesSpec(_Model):
    """Where the VMs' pip gets third-party packages (AWS and GCP VMs; the local cloud runs in
    the controller's own environment)."""

    index_url: str | None = Field(
        None, description="the index instead of PyPI (PEP 503 simple URL), e.g. a mirror"
    )
    extra_index_urls: tuple[str, ...] = Field((), description="more indexes pip also searches")
    find_links: tuple[str, ...] = Field(
        (), description="http(s) pages or folders of wheels pip also searches"
    )
    credentials_secret: str | None = Field(
        None,
        description="the cloud secret holding USER:PASSWORD (or a token) for these URLs' "
        "hosts, read at boot into a root-only pip configuration (" + SECRET_STORE_HINT + ")",
    )
    python: str = Field(
        DEFAULT_PYTHON,
        description="the python3 of the VMs' image (major.minor): the environment is resolved "
        "for it, and a VM whose python3 differs stops at boot saying so",
    )

    @field_validator("index_url")
    @classmethod
    def _index(cls, v: str | None) -> str | None:
        return None if v is None else _index_url(v, "index_url")

    @field_validator("extra_index_urls")
    @classmethod
    def _extra(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(_index_url(u, "extra_index_urls") for u in v)

    @field_validator("find_links")
    @classmethod
    def _links(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(_index_url(u, "find_links") for u in v)

    @field_validator("credentials_secret")
    @classmethod
    def _secret(cls, v: str | None) -> str | None:
        return None if v is None else check_secret_name(v)

    @field_validator("python")
    @classmethod
    def _python(cls, v: str) -> str:
        if not _PYTHON_RE.match(v):
            raise ValueError(
                f"{v!r} is not a Python spottrain runs on: give major.minor, 3.11 or newer"
            )
        return v

    @model_validator(mode="after")
    def _credentials_need_urls(self) -> Self:
        if self.credentials_secret and not self.urls():
            raise ValueError(
                "credentials_secret is set but no index_url, extra_index_urls or find_links "
                "says where to send them"
            )
        return self

    def urls(self) -> list[str]:
        """Every URL pip reaches besides its default index."""
        return [
            *([self.index_url] if self.index_url else []),
            *self.extra_index_urls,
            *self.find_links,
        ]

    def trusted_hosts(self) -> list[str]:
        """The hosts of the ``http://`` URLs: pip ignores a plain-HTTP index unless told to
        trust its host, and a URL written here is trusted as it is written (an index on a
        private network; prefer https)."""
        hosts = {
            u.split("://", 1)[1].split("/", 1)[0] for u in self.urls() if u.startswith("http://")
        }
        return sorted(hosts)

    def pip_args(self) -> list[str]:
        """The pip options that name these sources (no credentials: there are none here)."""
        out: list[str] = []
        for host in self.trusted_hosts():
            out += ["--trusted-host", host]
        if self.index_url:
            out += ["--index-url", self.index_url]
        for u in self.extra_index_urls:
            out += ["--extra-index-url", u]
        for u in self.find_links:
            out += ["--find-links", u]
        return out
