"""How users reach the engine: the offline `LLM` API, the command line and the OpenAI-compatible server."""
