"""The engine: requests in, one scheduled model step at a time, outputs out; and its asyncio wrapper."""
