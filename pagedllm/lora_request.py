"""Which LoRA adapter a request runs with, named as vLLM's LoRARequest."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter folder (adapter_config.json + adapter_model.safetensors) under a name and a positive id; the id
    is the engine's key (two requests with the same id share the adapter), the name what clients and metrics use."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
