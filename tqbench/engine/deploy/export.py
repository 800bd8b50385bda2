"""``export``: a policy as an engine's closest KV setting, measured here next to the original.

``export_policy(policy, "llamacpp", engine=Engine)`` maps the policy (``mapping.map_policy``) and, unless
``measure=False``, runs the engine's teacher-forced quality (``validate.quality.teacher_forced_quality``: KL to
the dense baseline, top-1 agreement, perplexity) on the original and on the mapped setting, so the user sees
what carrying the policy to that engine costs. Without a loaded model it maps on a geometry alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from tqbench.engine.deploy.mapping import EngineSetting, map_policy
from tqbench.engine.events import CancelFlag, OnEvent
from tqbench.engine.policy.files import parse_policy
from tqbench.engine.policy.spec import Policy

__all__ = ["ENGINE_CHECK", "ExportReport", "export_policy"]

#: how far each engine's measurement here goes: llama.cpp runs in the loop; the others are reproduced in storage only
ENGINE_CHECK = {
    "llamacpp": "storage bit-exact; llama.cpp's CPU compute path modelled (predicted KLD in llama-perplexity's "
                "protocol) and checked in llama.cpp itself on request",
    **{e: "storage-only reproduction: the engine's KV bytes bit-exact, attention and weights are tqbench's; not "
          "run in the engine (no CPU build of it runs here)" for e in ("vllm", "sglang", "trtllm")},
}


@dataclass(frozen=True)
class ExportReport:
    setting: EngineSetting
    model: str
    measured: object | None = None  # validate.quality.TeacherForcedReport: results[0] original, [1] mapped
    warning: str | None = None  # the policy was fitted on another model
    llamacpp_kld: object | None = None  # llamacpp_verify.LlamaCppKldReport: llama-perplexity's KLD, predicted (+measured)
    llamacpp_kld_skipped: str | None = None  # why it was not predicted

    @property
    def original(self):
        return self.measured.results[0] if self.measured is not None else None

    @property
    def mapped(self):
        return self.measured.results[1] if self.measured is not None else None

    @property
    def cost(self) -> dict | None:
        """What deploying on the engine's setting costs against the policy, measured here: KL and bits/element
        (at ``seq_len``) of the mapped setting minus the policy's (None when not measured)."""
        if self.measured is None:
            return None
        o, m, s = self.original, self.mapped, self.setting
        return {"kl_mean_delta": m.kl_mean - o.kl_mean, "top1_delta": m.top1_agreement - o.top1_agreement,
                "bits_per_element_delta": s.mapped_bits - s.original_bits,
                "bytes_ratio": s.mapped_bits / s.original_bits if s.original_bits else None}

    def to_dict(self) -> dict:
        out = {"model": self.model, **self.setting.to_dict(), "warning": self.warning,
               "engine_check": ENGINE_CHECK[self.setting.engine]}
        if self.measured is not None:
            m = self.measured
            out["measured"] = {
                "source": m.source, "cache_mode": m.cache_mode, "prefill_tokens": m.prefill_tokens,
                "steps": m.steps, "original": self.original.to_dict(), "mapped": self.mapped.to_dict(),
            }
            out["cost"] = self.cost
        if self.llamacpp_kld is not None:
            out["llamacpp_kld"] = self.llamacpp_kld.to_dict()
        elif self.llamacpp_kld_skipped:
            out["llamacpp_kld"] = {"skipped": self.llamacpp_kld_skipped}
        return out


def export_policy(
    policy: Policy | str,
    engine_name: str,
    *,
    engine=None,
    geometry=None,
    model_name: str = "",
    seq_len: int = 1024,
    measure: bool = True,
    corpus: str = "rivers",
    context_tokens: int = 256,
    eval_tokens: int = 64,
    cache_mode: str = "compressed",
    on_event: OnEvent | None = None,
    cancel: CancelFlag | None = None,
    llamacpp_kld: str = "predict",
    kld_texts: tuple[str, ...] | None = None,
    kld_ctx: int = 1024,
    kld_chunks: int | None = None,
    threads: int = 2,
    progress=None,
    setting: EngineSetting | None = None,
) -> ExportReport:
    """Map ``policy`` to ``engine_name`` for ``engine``'s model (or ``geometry`` of ``model_name``), and measure
    both unless ``measure`` is False (measuring needs ``engine``).

    For llama.cpp, when measuring, ``llamacpp_kld``: ``"predict"`` adds tqbench's prediction of
    llama-perplexity's KLD for the mapped flags (``llamacpp_verify``; on a model loaded from a GGUF file, the one
    llama.cpp runs), ``"verify"`` also runs those flags in llama.cpp (found or built, said through
    ``progress``) on the same texts, ``"off"`` neither; ``kld_chunks`` caps the chunks per text (None: the
default, ``llamacpp_verify.DEFAULT_KLD_CHUNKS``; llama-perplexity's ``--chunks``). ``setting``: the mapping
already made (``map_policy``: a front end prints it before measuring), not made again."""
    from tqbench.engine.policy.artifact import artifact_warning_for

    if llamacpp_kld not in ("off", "predict", "verify"):
        raise ValueError(f"llamacpp_kld={llamacpp_kld!r}: give off, predict or verify")
    if engine is None and geometry is None:
        raise ValueError("export needs a loaded model (engine) or a KV geometry to map the policy on")
    if measure and engine is None:
        raise ValueError("measuring the mapped setting needs a loaded model; pass measure=False to map only")
    geo = engine.geometry if engine is not None else geometry
    pol = parse_policy(policy)
    if setting is None:
        setting = map_policy(pol, engine_name, geo, seq_len)
    fingerprint = getattr(getattr(engine, "loaded", None), "fingerprint", None) if engine is not None else None
    warning = artifact_warning_for(policy, fingerprint, geo) if isinstance(policy, str) else None
    measured = None
    if measure:
        from tqbench.engine.validate.quality import teacher_forced_quality

        measured = teacher_forced_quality(
            engine, [pol, setting.mapped_policy], corpus=corpus, context_tokens=context_tokens,
            eval_tokens=eval_tokens, cache_mode=cache_mode, on_event=on_event, cancel=cancel,
        )
    kld, skipped = None, None
    if setting.engine == "llamacpp" and measure and llamacpp_kld != "off":
        from tqbench.constants import DEFAULT_KLD_CHUNKS
        from tqbench.engine.deploy.llamacpp_kld import VERIFY_TEXTS
        from tqbench.engine.deploy.llamacpp_verify import llamacpp_kld_report, model_gguf

        if llamacpp_kld == "verify" or model_gguf(engine) is not None:
            kld = llamacpp_kld_report(engine, setting.k_type, setting.v_type, texts=tuple(kld_texts or VERIFY_TEXTS),
                                      n_ctx=kld_ctx, verify=llamacpp_kld == "verify", threads=threads,
                                      progress=progress, cancel=cancel, on_event=on_event,
                                      chunks=DEFAULT_KLD_CHUNKS if kld_chunks is None else kld_chunks)
        else:
            skipped = (f"{engine.name} was not loaded from a GGUF file: llama.cpp's weight products (quantized "
                       "activations) cannot be modelled, so its KLD is not predicted")
    name = engine.name if engine is not None else f"{model_name or 'a model'} (geometry only, not measured)"
    return ExportReport(setting, name, measured, warning, kld, skipped)
