"""Global instance templates: insert, get, and how a group names its template."""

from __future__ import annotations

import copy
import re
from typing import Any

from .common import API, ApiError, check_name, invalid, not_found, parse_body, timestamp
from .state import GceState

# Terraform's self_link_unique adds ?uniqueId=ID; the last segment may be the id itself.
_TEMPLATE_URL_RE = re.compile(
    r"^(https?://[^/]+/compute/v1/)?(projects/(?P<p>[^/]+)/)?global/instanceTemplates/"
    r"(?P<n>[^/?]+)(\?uniqueId=(?P<uid>[0-9]+))?\Z"
)


class TemplatesMixin(GceState):
    def forget_template(self, name: str) -> None:
        """Delete the instance template, as a later ``terraform apply`` that replaced it does;
        groups and members that still name it keep its URL, and a group whose own template it
        was can no longer create VMs (their members stay ``CREATING``).

        Raises:
            KeyError: no template of that name.
        """
        with self._lock:
            del self._templates[name]

    def template(self, name: str) -> dict[str, Any] | None:
        with self._lock:
            found = self._templates.get(name)
            return None if found is None else copy.deepcopy(found)

    def _insert_template(self, body: dict[str, Any]) -> dict[str, Any]:
        name = body.get("name", "")
        check_name(name)
        if name in self._templates:
            raise ApiError(
                409,
                f"The resource 'projects/{self.project}/global/instanceTemplates/{name}' "
                "already exists",
                "alreadyExists",
            )
        properties = body.get("properties")
        if not isinstance(properties, dict) or not properties:
            raise ApiError(400, "Invalid value for field 'resource.properties': ''.", "required")
        self._validate_properties(properties, None, "resource.properties")
        stored = copy.deepcopy(body)
        stored.update(
            kind="compute#instanceTemplate",
            id=str(next(self._ids)),
            creationTimestamp=timestamp(),
            selfLink=f"{API}/projects/{self.project}/global/instanceTemplates/{name}",
        )
        self._templates[name] = stored
        return self._new_operation(None, "insert", stored)

    def _template_by(self, name_or_id: str) -> dict[str, Any] | None:
        """A template by its name or, as the API allows for any resource, its numeric id."""
        if name_or_id.isdigit():
            return next((t for t in self._templates.values() if t["id"] == name_or_id), None)
        return self._templates.get(name_or_id)

    def _template_at(self, url: str) -> dict[str, Any] | None:
        """The template a reference names (None if it does not exist, or no longer has the
        ``uniqueId`` the reference pins)."""
        m = _TEMPLATE_URL_RE.match(url)
        if m is None:
            return None
        template = self._template_by(m["n"])
        if template is None or m["uid"] not in (None, template["id"]):
            return None
        return template

    def _template_link(self, url: str, field_name: str) -> str:
        """The full URL of the template a request names, as the group keeps it.

        Whether the real API keeps a ``?uniqueId=`` suffix in what it answers is not
        documented; the fake keeps it, the harder case for a client that parses the URL.
        """
        m = _TEMPLATE_URL_RE.match(url)
        if m is None or m["p"] not in (None, self.project):
            raise invalid(field_name, url, "Expected a global instance template URL.")
        if self._template_at(url) is None:
            raise not_found(f"projects/{self.project}/global/instanceTemplates/{m['n']}")
        return f"{API}/projects/{self.project}/global/instanceTemplates/{url.rsplit('/', 1)[-1]}"

    def _serve_templates(
        self, call: str, zone: str, name: str, query: dict[str, str], raw: bytes
    ) -> tuple[int, dict[str, Any]] | None:
        if call == "instanceTemplates.insert":
            return 200, self._insert_template(parse_body(raw))
        if call == "instanceTemplates.get":
            template = self._template_by(name)
            if template is None:
                raise not_found(f"projects/{self.project}/global/instanceTemplates/{name}")
            return 200, copy.deepcopy(template)
        return None
