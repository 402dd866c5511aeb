"""The Redis quorum's script calls as the bench's asyncio clients send them: exactly
``spottrain.quorum.scripts``' Lua, keys, argument layout and answer parser, as its blocking
``QuorumClient`` passes them (built here from the same helpers, so they cannot drift)."""

from __future__ import annotations

import secrets
from typing import Any

from spottrain.protocol.keys import RunKeys
from spottrain.quorum import scripts
from spottrain.quorum.model import Answer, BatchItem, Member, QuorumConfig


def sources() -> dict[str, str]:
    return dict(scripts.ALL)


class Calls:
    """The EVALSHA argument lists of each script, given the SHA1s ``SCRIPT LOAD`` returned."""

    def __init__(self, keys: RunKeys, config: QuorumConfig, shas: dict[str, str]) -> None:
        self.keys = keys
        self.shas = shas
        self._keys = scripts.script_keys(keys)
        self._epoch = secrets.token_hex(4)  # what QuorumClient passes: one per client
        self.config = config

    @property
    def config(self) -> QuorumConfig:
        return self._config

    @config.setter
    def config(self, config: QuorumConfig) -> None:
        self._config = config
        self._head = scripts.config_args(self.keys, config, self._epoch)

    def _eval(self, name: str, *own: Any) -> tuple[Any, ...]:
        return ("EVALSHA", self.shas[name], len(self._keys), *self._keys, *self._head, *own)

    def request(self, replica_id: str, step: int, held_qid: int, token: str) -> tuple[Any, ...]:
        return self._eval(
            "REQUEST", *scripts.request_args(replica_id, step, held_qid, 0, False, token)
        )

    def relay_request(
        self, batch: str, ids: list[str], step: int, held_qid: int
    ) -> tuple[Any, ...]:
        items = [BatchItem(rid, step) for rid in ids]
        return self._eval("RELAY_REQUEST", *scripts.relay_args(batch, items, [held_qid] * len(ids)))

    def relay_tick(self, batch: str, ids: list[str]) -> tuple[Any, ...]:
        return self._eval("RELAY_TICK", batch, "wait", *ids)

    def relay_key(self, batch: str) -> str:
        return scripts.relay_key(self.keys, batch)

    def reply_key(self, replica_id: str) -> str:
        return scripts.reply_key(self.keys, replica_id)

    def tick(self, replica_id: str, token: str, *withdraw: str) -> tuple[Any, ...]:
        return self._eval("TICK", replica_id, token, *withdraw)

    def heartbeat(self, ids: list[str]) -> tuple[Any, ...]:
        return self._eval("HEARTBEAT", *ids)

    def leave(self, replica_id: str) -> tuple[Any, ...]:
        return self._eval("LEAVE", replica_id)

    def join(self, member: Member) -> tuple[Any, ...]:
        return self._eval("JOIN", member.replica_id, scripts.member_json(member))


def parse_reply(element: bytes | str) -> tuple[str, Answer]:
    """A ``reply:<id>`` element -> (its request's token, the parsed answer)."""
    token, line = scripts.split_reply(element)
    return token, scripts.parse_answer(line)
