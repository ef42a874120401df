"""Sessions (docs/sessions.md): multi-turn requests that continue earlier ones without resending
their tokens. The HTTP side keeps each session's token tree (`store`); the scheduler side keeps the
session's KV in the radix cache while it is open (`component`)."""
