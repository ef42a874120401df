"""Role blocks rendered client-side with the model's own chat template.

A program writes `with s.user(): s += "..."`, so each role needs a prefix and a suffix that wrap
content the program appends piece by piece. They are derived from the Jinja template by rendering
small conversations around a sentinel content and cutting the text at the sentinel. Text the
template puts before the first message (a BOS token, a default system prompt when the first message
is not a system one) is the `preamble` for that first role.
"""

from __future__ import annotations

import datetime
import functools
import logging

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
# Neither may contain whitespace: templates `trim` contents.
_SENTINEL = "RADIXSERVE_CONTENT_7f3a"
_OTHER = "RADIXSERVE_OTHER_7f3a"


@functools.lru_cache(maxsize=16)
def _compile(template: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return env.from_string(template)


class ChatTemplate:
    def __init__(self, template: str | None, bos_token: str | None = None, eos_token: str | None = None):
        self.template = template
        self.special = {"bos_token": bos_token or "", "eos_token": eos_token or ""}
        self._affixes: dict[str, tuple[str, str]] = {}
        self._preambles: dict[str, str] = {}
        # a template that reads content only as a list of parts (vision-language models' templates,
        # e.g. SmolVLM's) gets each text as one text part
        self.parts = False
        if template:
            self._derive()
            if not self._affixes:
                self.parts = True
                self._derive()

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        if self.parts:
            messages = [
                {**m, "content": [{"type": "text", "text": m["content"]}]} if isinstance(m.get("content"), str) else m
                for m in messages
            ]
        return _compile(self.template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self.special
        )

    def _split(self, text: str, before: str) -> tuple[str, str]:
        if not text.startswith(before) or text.count(_SENTINEL) != 1:
            raise ValueError("template output is not a prefix extension")
        prefix, suffix = text[len(before) :].split(_SENTINEL)
        return prefix, suffix

    def _derive(self) -> None:
        """A role's affixes are what rendering one more message of that role adds around its
        content. Templates that reject a probe (no system role, strict alternation) fall back to
        a context without the system message, then to plain `Role: ` lines for that role."""
        msg = lambda role, content=_OTHER: {"role": role, "content": content}  # noqa: E731
        contexts = {
            "system": [[msg("user"), msg("assistant")], []],
            "user": [[msg("system")], []],
            "assistant": [[msg("system"), msg("user")], [msg("user")]],
        }
        for role, candidates in contexts.items():
            for context in candidates:
                try:
                    before = self.render(context) if context else ""
                    self._affixes[role] = self._split(self.render([*context, msg(role, _SENTINEL)]), before)
                    break
                except Exception:
                    continue
            else:
                logger.warning(
                    "the chat template cannot render a %s message; %s blocks use plain %r lines",
                    role,
                    role,
                    f"{role.capitalize()}: ",
                )
        # What precedes the role prefix when a conversation starts with each role.
        for role in self._affixes:
            try:
                head = self.render([msg(role, _SENTINEL)]).split(_SENTINEL)[0]
            except Exception:
                continue
            prefix = self._affixes[role][0]
            self._preambles[role] = head[: len(head) - len(prefix)] if head.endswith(prefix) else ""

    def affixes(self, role: str) -> tuple[str, str]:
        if role not in ROLES:
            raise ValueError(f"role = {role!r} must be one of {', '.join(ROLES)}")
        return self._affixes.get(role) or (f"{role.capitalize()}: ", "\n")

    def preamble(self, first_role: str) -> str:
        return self._preambles.get(first_role, "")
