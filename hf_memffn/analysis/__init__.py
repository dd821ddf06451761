"""Memory analysis: what do the FFN memories store?

Reads every FFN as unnormalized key-value memory, `FFN(x) = sum_i c_i(x) v_i` (keys detect input patterns, values
promote output tokens), for the four memffn architectures and any HF Llama-family model:

* `memory_banks(model)`: one `MemoryBank` per FFN (and per layer of the memory on X0), the single abstraction, which
  asks each FFN block through its memory interface (`hf_memffn.ffn.FeedForwardMemory`);
* `coefficients_for_ids` / `record_coefficients` / `summarize_coefficients`: memory coefficients and their summaries;
* `top_triggering_prefixes`: the prefixes that trigger each cell most over a dataset (streamed, bounded memory);
* `project_values` / `key_value_agreement`: the tokens each value promotes, and whether they follow the triggers;
* `token_memory_map` / `token_clusters` / `layer_contributions`: the token-to-memory map of MemoryLLM-style models;
* `edit_next_token` (`ValueEdit`, `TokenMemoryEdit`): memory editing and its effect on next-token predictions;
* `analyze` + `write_report`: everything at once, as JSON and a self-contained HTML report.

This subpackage is not imported by the modeling code (it may use matplotlib, numpy, tqdm).
"""

from .analyze import analyze, read_texts
from .coefficients import CoefficientSummary, coefficients_for_ids, record_coefficients, summarize_coefficients
from .editing import (
    EditResult,
    TokenMemoryEdit,
    ValueEdit,
    edit_next_token,
    find_trigger_cell,
    next_token_probabilities,
    promotion_direction,
)
from .memory_banks import GatedMLPMemory, MemoryBank, feed_forward_memory, memory_banks, select_banks
from .report import write_report
from .token_memory import LayerContributions, TokenCluster, layer_contributions, token_clusters, token_memory_map
from .triggers import TopKPerCell, Trigger, TriggerIndex, top_triggering_prefixes
from .vocabulary import ValueProjection, key_value_agreement, project_values, vocabulary_logits

__all__ = [
    "CoefficientSummary",
    "EditResult",
    "GatedMLPMemory",
    "LayerContributions",
    "MemoryBank",
    "TokenCluster",
    "TokenMemoryEdit",
    "TopKPerCell",
    "Trigger",
    "TriggerIndex",
    "ValueEdit",
    "ValueProjection",
    "analyze",
    "coefficients_for_ids",
    "edit_next_token",
    "feed_forward_memory",
    "find_trigger_cell",
    "key_value_agreement",
    "layer_contributions",
    "memory_banks",
    "next_token_probabilities",
    "project_values",
    "promotion_direction",
    "read_texts",
    "record_coefficients",
    "select_banks",
    "summarize_coefficients",
    "token_clusters",
    "token_memory_map",
    "top_triggering_prefixes",
    "vocabulary_logits",
    "write_report",
]
