"""A Falcon the fused mode refuses, and why, for the installed transformers: any Falcon before 5.25 (its
attention calls SDPA itself), an ALiBi one from 5.25 (its position bias rides in the attention mask)."""

from __future__ import annotations

from tqbench.engine.cache.geometry import falcon_attention_interface
from tqbench.engine.models.families import family_model

#: how the refusal message explains itself, after "FalconForCausalLM cannot run the fused cache mode: "
WHY = ("its ALiBi position bias reaches attention inside the attention mask" if falcon_attention_interface()
       else "its attention does not go through transformers' AttentionInterface")


def refused_falcon(**kwargs):
    """The LoadedModel of a random Falcon that the fused mode refuses."""
    return family_model("falcon", alibi=True, **kwargs) if falcon_attention_interface() else family_model(
        "falcon", **kwargs)
