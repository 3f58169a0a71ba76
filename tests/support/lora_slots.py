"""A worker extension that changes one element of an adapter's LoRA slot on one rank.

Loaded by vLLM in its worker processes (``worker_extension_cls="tests.support.lora_slots.LoRASlotExtension"``)
and driven through ``collective_rpc``: the fault a verified adapter must name is other bytes in one
rank's slot (a slice overwritten after ``set_lora``), which no request to the engine can make.
Arguments and results are builtins. Nothing here calls refit-verify.
"""

from __future__ import annotations

__all__ = ["LoRASlotExtension"]


class LoRASlotExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (``rank``, ``model_runner``)."""

    def lora_slot_add(self, adapter_id: int, layer: str, ab: str, s: int, row: int, col: int, value: float, rank: int) -> bool:
        """On worker ``rank`` only, add ``value`` to element ``[row, col]`` of slice ``s`` of ``layer``'s
        ``lora_{ab}_stacked`` in adapter ``adapter_id``'s slot; True where it changed something."""
        if self.rank != rank:
            return False
        am = self.model_runner.lora_manager._adapter_manager
        slot = am.lora_index_to_id.index(adapter_id)
        getattr(am.modules[layer], f"lora_{ab}_stacked")[s][slot, 0, row, col] += value
        return True
