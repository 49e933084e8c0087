"""Serving runtime: KV manager, scheduler, Llama-family executor, offline API."""
