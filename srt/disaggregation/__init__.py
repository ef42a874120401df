"""Prefill-decode disaggregation (SGLang's design): a prefill server computes a prompt's KV and
writes it into a decode server's pool over a transfer engine; the decode server only decodes."""
