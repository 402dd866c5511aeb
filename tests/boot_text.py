"""Reading a rendered VM boot in tests: the agent's settings it writes, and a whole boot
rendered with a lock (every job but an image job installs one)."""

from __future__ import annotations

from typing import Any

from wheelhouse import realistic_lock_text

from spottrain.controller.run.boot import (
    JOB_ENV_PATH,
    NODE_ENV_PATH,
    CodeRef,
    NodeIdentity,
    parse_env_file,
    render_boot_script,
)
from spottrain.spec import ImageCode, JobSpec

SHA = "ab" * 32
ARCHIVE = CodeRef(f"s3://b/code/{SHA}.tar.gz", SHA)


def _block(script: str, head: str) -> dict[str, str]:
    start = script.index(head) + len(head)
    return parse_env_file(script[start : script.index("\nENV\n", start)])


def agent_env_of(script: str) -> dict[str, str]:
    """The agent's env file as the boot assembles it: the job's part, then the VM's own."""
    job = _block(script, f"cat > {JOB_ENV_PATH} <<'ENV'\n")
    return {**job, **_block(script, f"cat > {NODE_ENV_PATH} <<'ENV'\n")}


def whole_boot(
    spec: JobSpec,
    node: NodeIdentity,
    redis_url: str,
    *,
    code: CodeRef | None = ARCHIVE,
    lock: str | None = None,
    **kw: Any,
) -> str:
    """A VM's whole boot (user data with the job's boot in place), with a realistic lock
    unless the job runs in its image."""
    if lock is None and not isinstance(spec.code, ImageCode):
        lock = realistic_lock_text()
    return render_boot_script(spec, node, redis_url, code=code, env_lock=lock, **kw)
