"""Conversions of trained models into deployable artefacts.

* `export_tols`: a MemoryLLM / FlexMemoryLLM's memory FFN as a token lookup table (`hf-memffn export-tols`).
* `demo_step`: export a checkpoint's table and show lookup-mode generation matching compute mode.
"""

from .export import export_tols, heldout_loss, lookup_loss_delta, push_table_to_hub
from .lookup_demo import demo_step

__all__ = ["export_tols", "heldout_loss", "lookup_loss_delta", "push_table_to_hub", "demo_step"]
