"""The Redis credentials a node's torchrun and workers get: a user of the run's own, not the
run's password.

Workers run the user's code, and a worker holding the run's Redis password could flush the
database, reconfigure the server or rewrite other runs' keys. So the agent, which holds the
password, gives its torchrun and workers a Redis ACL user limited to this run's keys and
channels (its replicas' rendezvous included), without the commands Redis marks dangerous or
administrative (``FLUSHALL``, ``CONFIG``, ``KEYS``, ``ACL``, ``SHUTDOWN``, ``MONITOR``, ...)
nor those that wipe the server's scripts and functions.

The user's name and password are derived from the run's password (:func:`worker_credentials`:
an HMAC, so every agent of the run makes the same user, the workers cannot work the run's
password back from theirs, and nothing new has to be shipped to a VM). Each agent sets the
user up (:meth:`WorkerAcl.ensure`, idempotent) before torchrun starts and again every
:data:`RECHECK_S` while it runs, so a Redis that restarted without its ACLs gets the user
back before torchrun's next reconnect needs it.

A Redis without ACLs (older than 6, or a managed one that refuses ``ACL SETUSER``) or one
whose password is not an admin's: the workers get the run's password as before, and the
agent says so once (an event and a warning naming the cause and the fix). Without a password
there is nothing to protect: Redis is open to whoever reaches it.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from dataclasses import dataclass

import redis

from spottrain.protocol.keys import RunKeys

log = logging.getLogger(__name__)

# Seconds between checks that the workers' user is still there (a Redis restart drops users
# made by ACL SETUSER unless the server saves them in an ACL file).
RECHECK_S = 10.0
# Dangerous and admin commands are out by category; these wipe or stall what every run on
# the server shares and are in neither category.
DENIED = (
    "-script|flush",
    "-script|kill",
    "-function|flush",
    "-function|delete",
    "-function|restore",
    "-function|kill",
)


@dataclass(frozen=True)
class WorkerCredentials:
    """The Redis user a node's torchrun and workers log in as."""

    username: str
    password: str


def worker_credentials(keys: RunKeys, run_password: str) -> WorkerCredentials:
    """The workers' user of the run ``keys`` names: the same on every VM of the run."""
    mac = hmac.new(run_password.encode(), f"spottrain-workers\0{keys.base}".encode(), "sha256")
    return WorkerCredentials(f"{keys.prefix}-workers-{keys.run_id}", mac.hexdigest())


def acl_rules(keys: RunKeys, creds: WorkerCredentials) -> list[str]:
    """``ACL SETUSER`` rules for the workers' user: this run's keys and channels (and its
    replicas' rendezvous, ``<run>.<slot>``), every command but the dangerous and admin ones
    and :data:`DENIED`; the password given as its sha256 (never sent in the clear)."""
    digest = hashlib.sha256(creds.password.encode()).hexdigest()
    mine = f"{keys.prefix}:{{{keys.run_id}}}:*"
    replicas = f"{keys.prefix}:{{{keys.run_id}.*}}:*"
    return [
        "reset",
        "on",
        f"#{digest}",
        f"~{mine}",
        f"~{replicas}",
        f"&{mine}",
        f"&{replicas}",
        "+@all",
        "-@dangerous",
        "-@admin",
        *DENIED,
    ]


class WorkerAcl:
    """Sets the workers' user up in the run's Redis, through the agent's own client.

    Args:
        client: the agent's client (logged in with the run's password).
        keys: the run's keys.
        run_password: the run's Redis password (None: Redis has none, nothing to do).
    """

    def __init__(self, client: redis.Redis, keys: RunKeys, run_password: str | None) -> None:
        self.client = client
        self.keys = keys
        self.creds = worker_credentials(keys, run_password) if run_password else None
        self.problem = ""  # why the workers get the run's password, once known
        self._checked_at: float | None = None

    def ensure(self, now: float) -> WorkerCredentials | None:
        """Set the user up (again) when :data:`RECHECK_S` passed since the last check.

        Returns:
            The workers' credentials; None when they get the run's password: Redis has
            none, or refused to make the user (:attr:`problem` says why). A Redis that does
            not answer now is asked again at the next check (torchrun cannot reach it
            either, and reconnects once it is back).
        """
        if self.creds is None or self.problem:
            return None
        if self._checked_at is not None and now - self._checked_at < RECHECK_S:
            return self.creds
        self._checked_at = now
        try:
            self.client.execute_command(
                "ACL", "SETUSER", self.creds.username, *acl_rules(self.keys, self.creds)
            )
        except redis.ResponseError as exc:
            # No ACLs here, or the run's password may not manage them: for good.
            self.problem = (
                f"Redis refused to make the workers' user ({str(exc)[:200]}): the workers get "
                "the run's password, which can flush or reconfigure Redis; use Redis 6 or "
                "later with a password that may run ACL SETUSER"
            )
            log.warning("%s", self.problem)
            return None
        except redis.RedisError as exc:
            log.warning("could not set up the workers' Redis user (retried): %s", exc)
        return self.creds
