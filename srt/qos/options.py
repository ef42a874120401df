"""The priorities-and-tenants option group's start-up checks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from srt.qos.tenants import load_tenant_config

if TYPE_CHECKING:
    from srt.server_args import ServerArgs


def check_qos_server_args(server_args: ServerArgs) -> None:
    a = server_args
    if a.enable_priority_scheduling and a.abort_on_priority_when_disabled:
        raise ValueError("--abort-on-priority-when-disabled contradicts --enable-priority-scheduling")
    if not a.enable_priority_scheduling:
        for flag, on in (
            ("--schedule-low-priority-values-first", a.schedule_low_priority_values_first),
            ("--default-priority-value", a.default_priority_value is not None),
            ("--disable-priority-preemption", a.disable_priority_preemption),
        ):
            if on:
                raise ValueError(f"{flag} needs --enable-priority-scheduling")
    load_tenant_config(a)  # a bad file fails at start-up, naming the field
