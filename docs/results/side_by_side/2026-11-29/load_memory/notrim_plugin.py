"""pytest plugin: the engine's heap trim turned off (a probe)."""
from pagedllm.model import heap

heap.trim = lambda: False
