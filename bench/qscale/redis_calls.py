"""The Redis quorum's script calls as the bench's asyncio clients send them: exactly
``spottrain.quorum.scripts``' Lua and its answer parser, with the keys and arguments its
blocking client passes (one place, so the bench cannot drift from the client)."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from spottrain.protocol.keys import RunKeys
from spottrain.quorum import scripts
from spottrain.quorum.model import Answer, Member, QuorumConfig

NAMES = ("REQUEST", "TICK", "HEARTBEAT", "LEAVE", "JOIN")


def sources() -> dict[str, str]:
    return {name: getattr(scripts, name) for name in NAMES}


class Calls:
    """The argument lists of EVALSHA for each script, given the SHA1s Redis returned for
    ``SCRIPT LOAD``."""

    def __init__(self, keys: RunKeys, config: QuorumConfig, shas: dict[str, str]) -> None:
        self.keys = keys
        self.config = config
        self.shas = shas
        self.base = keys.quorum_base

    def _cfg(self) -> list[Any]:
        c = self.config
        return [c.heartbeat_timeout_ms, c.join_timeout_ms, c.min_replicas]

    def request(self, replica_id: str, step: int, held_qid: int) -> tuple[Any, ...]:
        return (
            "EVALSHA",
            self.shas["REQUEST"],
            0,
            self.base,
            replica_id,
            step,
            held_qid,
            0,
            0,
            *self._cfg(),
        )

    def reply_key(self, replica_id: str) -> str:
        return self.keys.quorum_key(f"reply:{replica_id}")

    def tick(self) -> tuple[Any, ...]:
        return ("EVALSHA", self.shas["TICK"], 0, self.base, *self._cfg())

    def heartbeat(self, ids: list[str]) -> tuple[Any, ...]:
        return ("EVALSHA", self.shas["HEARTBEAT"], 0, self.base, *self._cfg(), *ids)

    def leave(self, replica_id: str) -> tuple[Any, ...]:
        return ("EVALSHA", self.shas["LEAVE"], 0, self.base, replica_id, *self._cfg())

    def join(self, member: Member) -> tuple[Any, ...]:
        return (
            "EVALSHA",
            self.shas["JOIN"],
            0,
            self.base,
            member.replica_id,
            json.dumps(asdict(member)),
        )


def parse_answer(line: bytes | str) -> Answer:
    return scripts.parse_answer(line.decode() if isinstance(line, bytes) else line)
