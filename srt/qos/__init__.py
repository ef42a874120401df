"""Quality of service (docs/qos.md): priorities with preemption and tenants' fair shares in the
scheduler (`component`), per-tenant request and token budgets at the door (`tenants`)."""
