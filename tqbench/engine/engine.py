"""``Engine``: load a model once, generate many times under any KV policy and cache mode."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator

import torch

from tqbench.constants import KERNEL_BASELINES
from tqbench.engine.cache.dense_baseline import (
    baseline_kv_dtype,
    bytes_policy,
    dense_cache,
    is_dense_baseline,
)
from tqbench.engine.cache.geometry import KVGeometry
from tqbench.engine.cache.tqcache import TQCache, check_mode
from tqbench.engine.events import CacheBytes, GenerationFinished, KeptTokens, TokenGenerated
from tqbench.engine.generate import GREEDY, GenerationResult, Sampling, Sequence, lockstep, stream_tokens
from tqbench.engine.models import LoadedModel, load_model, tiny_model
from tqbench.engine.policy.checked import CheckedPolicy
from tqbench.engine.policy.files import parse_policy
from tqbench.engine.policy.spec import Policy
from tqbench.engine.request import PromptTooLongError, check_context, check_prompt

__all__ = ["Engine", "Prompt", "PromptTooLongError"]

Prompt = str | list[dict]


class Engine:
    """One loaded model; every front end (CLI, TUI, server) drives it through these methods."""

    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.config = self.model.config
        self._fused_ready = False

    @classmethod
    def load(cls, model: str | None = None, device: str = "auto", dtype: str = "auto",
             threads: int | None = None, on_progress: Callable[[str], None] | None = None) -> Engine:
        return cls(load_model(model, device=device, dtype=dtype, threads=threads, on_progress=on_progress))

    @classmethod
    def tiny(cls, **kwargs) -> Engine:
        return cls(tiny_model(**kwargs))

    # -- info -------------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.loaded.name

    @property
    def geometry(self) -> KVGeometry:
        """The model's KV geometry (layers, KV heads, head size, layer types), read once from its config."""
        return KVGeometry.from_config(self.config)

    @property
    def max_context(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 0) or 0)

    @property
    def eos_ids(self) -> set[int]:
        ids = set()
        for src in (getattr(self.model, "generation_config", None), self.config):
            eos = getattr(src, "eos_token_id", None) if src is not None else None
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, (list, tuple)):
                ids.update(int(e) for e in eos)
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids

    # -- prompts ------------------------------------------------------------------------------------
    def encode_prompt(self, prompt: Prompt, chat: bool = True, max_new_tokens: int = 0, *,
                      fit_context: bool = True) -> torch.Tensor:
        """Token ids ``[1, T]``. With ``chat`` a string becomes one user message of the chat template.
        ``fit_context``: refuse a prompt (plus ``max_new_tokens``) longer than the model's context; a caller that
        truncates the ids itself passes False and checks what it keeps."""
        if isinstance(prompt, str):
            check_prompt(prompt)
        has_template = bool(getattr(self.tokenizer, "chat_template", None))
        if chat and has_template:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            enc = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
            ids = enc["input_ids"] if not isinstance(enc, torch.Tensor) else enc
        else:
            if not isinstance(prompt, str):
                prompt = "\n".join(m.get("content", "") for m in prompt)
            ids = self.tokenizer(prompt, return_tensors="pt")["input_ids"]
        if fit_context:
            check_context(int(ids.shape[1]), max_new_tokens, self.max_context, self.name)
        return ids

    # -- caches -------------------------------------------------------------------------------------
    def make_cache(self, policy: Policy | str | CheckedPolicy | None, cache_mode: str = "compressed"):
        """A plain ``DynamicCache`` for ``None``; a dense baseline for a ``DENSE_BASELINES`` name (``dense-fp16``:
        16-bit K/V rows, upcast for attention; ``cache.dense_baseline``; ``dense-fp16-kernel``: the same rows read by
        the native kernel, which this wires, ``cache.dense_kernel``); a ``TQCache`` otherwise (fused mode wires
        the attention).

        A policy fitted on another model warns here (``policy_warning``; the cache's ``policy_warning`` holds it)."""
        if policy is None or is_dense_baseline(policy):
            cache = dense_cache(self.config, policy, self.loaded.device)
            if policy in KERNEL_BASELINES:  # its attention is tqbench's (the native kernel over the 16-bit rows)
                self.enable_fused()
            return cache
        check_mode(cache_mode)
        checked = self.check_policy(policy)
        if cache_mode == "fused":
            self.enable_fused()
        elif checked.policy.evicts:  # eviction scores read the queries in that function
            from tqbench.engine.cache.fused import FusedUnsupportedError
            from tqbench.engine.cache.fused.support import EvictionUnsupportedError

            try:
                self.enable_fused()
            except FusedUnsupportedError as exc:
                raise EvictionUnsupportedError(exc) from None
        if checked.warning:
            warnings.warn(checked.warning, stacklevel=2)
        self.check_transforms(checked.policy)
        return TQCache(checked, self.config, mode=cache_mode)  # checked here: the cache does not check it again

    def baseline_kv_dtype(self, baseline: str | None = None) -> str:
        """The dtype a dense baseline (None: ``dense``) stores this model's K/V rows in, e.g. ``float16``."""
        return baseline_kv_dtype(baseline, self.loaded.dtype)

    def check_policy(self, policy: Policy | str | CheckedPolicy) -> CheckedPolicy:
        """``policy`` parsed, planned on this model's layers (a selector past the last layer is refused) and its
        provenance checked (``policy_warning``), once: jobs and caches take the ``CheckedPolicy`` as it is (one
        already checked on this model is returned unchanged). When it was fitted on another model a refusal says
        so, since that is usually why."""
        fingerprint = self.loaded.fingerprint
        if isinstance(policy, CheckedPolicy) and policy.fingerprint == fingerprint:
            return policy
        pol = parse_policy(policy)
        warning = self._fitted_warning(pol)
        geo = self.geometry
        types = list(geo.layer_types) if geo.layer_types else None
        try:
            plans = pol.plan(geo.num_layers, types)
        except ValueError as exc:
            if warning:
                raise ValueError(f"{str(exc).splitlines()[0]}; {warning}") from None
            raise
        return CheckedPolicy(pol, warning, fingerprint, tuple(plans), (geo.num_layers, tuple(types) if types else None))

    def check_transforms(self, policy: Policy | str) -> None:
        """Refuse a policy whose calibrated (``pcaq``) key codecs use transforms fitted on another model
        (``TransformsMismatch`` says which model they were fitted on and how to refit)."""
        from tqbench.engine.codecs import is_calibrated_spec
        from tqbench.engine.codecs.transforms_file import load_transforms

        pol = parse_policy(policy)
        if any(is_calibrated_spec(s) for s in (pol.k, *(spec for _, _, spec in pol.overrides))):
            load_transforms(pol.calib).check_model(self.loaded.fingerprint, self.name)

    def savings(self, policy: Policy | str, baseline: Policy | str, seq_len: int):
        """``cache.savings.Savings`` of ``policy`` against ``baseline`` at ``seq_len`` tokens of this model (the
        break-even search stops at the model's context): whether it stores fewer bytes, why not, from when."""
        from tqbench.engine.cache.savings import savings

        if is_dense_baseline(baseline):  # the dense policy holding the same bytes
            baseline = bytes_policy(baseline, self.loaded.dtype)
        return savings(policy, baseline, self.geometry, seq_len, self.max_context)

    def policy_warning(self, policy: Policy | str | None) -> str | None:
        """Why ``policy`` may not suit this model: it was read from a saved artifact fitted on another model (the
        fingerprint differs; or, when none is recorded, the KV geometry), else None. Works on every form a policy
        arrives in (artifact path, shipped name, parsed ``Policy``): the parsed ``Policy`` carries ``fitted_on``.
        Every front end shows it; ``make_cache`` also warns."""
        if policy is None or is_dense_baseline(policy):
            return None
        if isinstance(policy, CheckedPolicy) and policy.fingerprint == self.loaded.fingerprint:
            return policy.warning
        return self._fitted_warning(parse_policy(policy))

    def _fitted_warning(self, pol: Policy) -> str | None:
        return pol.fitted_on.warning(self.loaded.fingerprint, self.geometry) if pol.fitted_on else None

    def enable_fused(self) -> None:
        if not self._fused_ready:
            from tqbench.engine.cache.fused import install_fused_attention

            install_fused_attention(self.model)
            self._fused_ready = True

    # -- generation ---------------------------------------------------------------------------------
    def stream(
        self,
        prompt: Prompt | torch.Tensor,
        policy: Policy | str | None = "fp16",
        cache_mode: str = "compressed",
        *,
        max_new_tokens: int = 64,
        chat: bool = True,
        sampling: Sampling = GREEDY,
        stop_at_eos: bool = True,
        stop: list[str] | None = None,
        collect_logits: bool = False,
        cancel: Callable[[], bool] | None = None,
        run: str = "candidate",
        track_bytes: bool = False,
        logprobs: int | None = None,
        echo: bool = False,
        prefill_chunk: int | None = None,
        prompt_lookup: int = 0,
        track_kept: bool = False,
        context=None,
    ) -> Iterator[object]:
        """Yield ``GenerationStarted``, ``PrefillDone``, ``TokenGenerated``... and ``GenerationFinished``.

        With ``track_bytes`` a ``CacheBytes`` event follows every ``TokenGenerated`` (compressed caches only);
        with ``track_kept`` a policy that evicts tokens (``keep``) yields a ``KeptTokens`` (the positions each KV
        head still holds) just before ``GenerationFinished``.
        ``logprobs`` (the number of top alternatives, 0 for none) adds a ``TokenLogprob`` to every
        ``TokenGenerated``; ``echo`` adds a ``PromptScored`` after the prefill (and allows
        ``max_new_tokens=0``); ``prefill_chunk`` feeds the prompt in forward calls of that many tokens (0: one call;
        None: chosen by length and mode, ``constants.auto_prefill_chunk``); ``prompt_lookup`` > 0 decodes with
        prompt-lookup speculation, up to that many draft tokens verified per forward call (greedy only; the
        tokens are greedy decoding's, ``GenerationResult.speculation`` counts the drafts).
        ``context``: a ``CompressedContext`` (``compress``): ``prompt`` (ids, or text tokenized as is) is appended to
        a copy of its compressed cache, under its policy and cache mode (``policy``/``cache_mode``/``chat`` unused).
        A policy whose score reads a context pass (``score=kvzip``) runs it over the prompt first
        (``GenerationResult.context_pass_seconds``).
        """
        pass_seconds = 0.0
        if context is not None:
            if prompt_lookup:
                raise ValueError("prompt_lookup cannot run on a compressed context (its rows cannot be cropped)")
            ids = prompt if isinstance(prompt, torch.Tensor) else self.tokenizer(
                prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
            check_context(context.tokens + int(ids.shape[1]), max_new_tokens, self.max_context, self.name)
            cache, label, mode = context.fork(), context.label, context.cache_mode
            pol = context.policy if isinstance(cache, TQCache) else None
        else:
            dense = policy is None or is_dense_baseline(policy)  # a DynamicCache baseline (``cache.dense_baseline``)
            pol = None if dense else self.check_policy(policy)
            ids = prompt if isinstance(prompt, torch.Tensor) else self.encode_prompt(prompt, chat, max_new_tokens)
            if prompt_lookup and pol is not None and cache_mode in ("compressed", "simulate"):
                self.enable_fused()  # a verification call's per-query precision runs in tqbench's attention function
            cache = self.make_cache(policy if dense else pol, cache_mode)
            label = pol.label if pol is not None else (policy or "dynamic-cache")
            mode = cache_mode if pol is not None else "dynamic"
            pass_seconds = self._context_pass(cache, ids)
        events = stream_tokens(
            self.model, self.tokenizer, ids, cache, run=run, kv_policy=label, cache_mode=mode,
            max_new_tokens=max_new_tokens, sampling=sampling, eos_ids=self.eos_ids if stop_at_eos else None,
            stop=stop, collect_logits=collect_logits, cancel=cancel,
            report=cache.report if isinstance(cache, TQCache) else None,
            logprobs=logprobs, echo=echo, prefill_chunk=prefill_chunk, prompt_lookup=prompt_lookup,
        )
        if pass_seconds:
            events = _with_pass_seconds(events, pass_seconds)
        if track_bytes and isinstance(cache, TQCache):
            events = _with_cache_bytes(events, cache)
        if track_kept and isinstance(cache, TQCache) and cache.policy.evicts:
            events = _with_kept_tokens(events, cache, ids if context is None else torch.cat(
                [context.ids.to(ids.device), ids], dim=1), self.tokenizer)
        return events

    def _context_pass(self, cache, ids: torch.Tensor) -> float:
        """A cache whose score reads a context pass (``score=kvzip``): run it over ``ids`` and hand the scores to
        the cache (``evict.reconstruct``); the seconds it took (0: none needed)."""
        if not (isinstance(cache, TQCache) and cache.needs_context_pass):
            return 0.0
        from tqbench.engine.cache.evict.reconstruct import context_scores
        from tqbench.engine.scan.capture import _base_attention

        scores, seconds = context_scores(self.model, self.tokenizer, ids, base=_base_attention(self.model))
        cache.set_context_scores(scores)
        return seconds

    def compress(self, context: str | torch.Tensor, policy: Policy | str | None = "fp16",
                 cache_mode: str = "compressed", *, prefill_chunk: int | None = None):
        """Prefill ``context`` (ids ``[1, N]``, or text tokenized as is) once under ``policy`` and compress it: an
        evicting policy keeps its rows at the end of the context, before any question (query-agnostic). Returns a
        ``CompressedContext`` whose ``stream``/``generate`` append a question to a copy of it, as many times as
        asked, without prefilling or scoring the context again (``tqbench.engine.context``)."""
        from tqbench.engine.context import compress

        return compress(self, context, policy, cache_mode, prefill_chunk=prefill_chunk)

    def sequence(
        self,
        ids: torch.Tensor,
        policy: Policy | str,
        cache_mode: str = "compressed",
        *,
        max_new_tokens: int = 64,
        sampling: Sampling = GREEDY,
        stop_at_eos: bool = True,
        stop: list[str] | None = None,
        cancel: Callable[[], bool] | None = None,
        run: str = "candidate",
        logprobs: int | None = None,
        echo: bool = False,
        prefill_chunk: int | None = None,
        context=None,
    ) -> Sequence:
        """The step machine behind ``stream`` (its own ``TQCache``), for a driver that batches decode steps
        across sequences (``tqbench.engine.batch.decode_step``); same arguments as ``stream``.

        ``context``: a ``CompressedContext`` (``compress``): ``ids`` are appended to a copy of its compressed
        cache under its policy and cache mode (``policy``/``cache_mode`` unused), as ``stream(context=)`` does;
        ``result.prefix_tokens`` counts the context's tokens (read, not prefilled)."""
        if context is not None:
            check_context(context.tokens + int(ids.shape[1]), max_new_tokens, self.max_context, self.name)
            if echo:
                raise ValueError("echo cannot run on a compressed context (its tokens are not scored again)")
            cache, label, cache_mode = context.fork(), context.label, context.cache_mode
            pass_seconds = 0.0
        else:
            pol = self.check_policy(policy)
            cache, label = self.make_cache(pol, cache_mode), pol.label
            pass_seconds = self._context_pass(cache, ids)
        seq = Sequence(
            self.model, self.tokenizer, ids, cache, run=run, kv_policy=label, cache_mode=cache_mode,
            max_new_tokens=max_new_tokens, sampling=sampling, eos_ids=self.eos_ids if stop_at_eos else None,
            stop=stop, cancel=cancel, report=cache.report, logprobs=logprobs, echo=echo,
            prefill_chunk=prefill_chunk,
        )
        seq.result.context_pass_seconds = pass_seconds
        if context is not None:
            seq.result.prefix_tokens = context.tokens
        return seq

    def decode_step(self, seqs: list[Sequence]) -> float:
        """One forward call over every sequence's ``next_token`` (batched when more than one); returns seconds."""
        from tqbench.engine.batch import decode_step

        return decode_step(self.model, seqs)

    def generate(self, prompt: Prompt | torch.Tensor, policy: Policy | str | None = "fp16",
                 cache_mode: str = "compressed", **kwargs) -> GenerationResult:
        result = None
        for ev in self.stream(prompt, policy, cache_mode, **kwargs):
            if isinstance(ev, GenerationFinished):
                result = ev.result
        assert result is not None
        return result

    def lockstep(
        self,
        prompt: Prompt,
        baseline: Policy | str | None = "fp16",
        candidate: Policy | str = "turbo4",
        *,
        baseline_mode: str = "compressed",
        candidate_mode: str = "compressed",
        chat: bool = True,
        max_new_tokens: int = 64,
        sampling: Sampling = GREEDY,
        collect_logits: bool = True,
        cancel: Callable[[], bool] | None = None,
        track_bytes: bool = False,
        prefill_chunk: int | None = None,
        track_kept: bool = False,
    ) -> Iterator[object]:
        """Baseline and candidate generate side by side; yields both streams' events and ``PairStep``s."""
        ids = self.encode_prompt(prompt, chat, max_new_tokens)
        common = dict(max_new_tokens=max_new_tokens, sampling=sampling, collect_logits=collect_logits,
                      cancel=cancel, track_bytes=track_bytes, prefill_chunk=prefill_chunk, track_kept=track_kept)
        return lockstep(
            self.stream(ids, baseline, baseline_mode, run="baseline", **common),
            self.stream(ids, candidate, candidate_mode, run="candidate", **common),
        )


def _with_kept_tokens(events: Iterator[object], cache: TQCache, ids: torch.Tensor, tokenizer) -> Iterator[object]:
    """Pass ``events`` through; before ``GenerationFinished``, say which positions each evicting head kept."""
    from tqbench.engine.cache.evict.kept import kept_positions

    fed = [int(i) for i in ids[0].tolist()]
    for ev in events:
        if isinstance(ev, TokenGenerated):
            fed.append(ev.token_id)
        elif isinstance(ev, GenerationFinished):
            kept = kept_positions(cache)
            if kept is not None:
                seen = fed[: kept.seen]
                texts = tuple(tokenizer.decode([t], skip_special_tokens=False) for t in seen)
                yield KeptTokens(ev.run, kept, tuple(seen), texts)
        yield ev


def _with_pass_seconds(events: Iterator[object], seconds: float) -> Iterator[object]:
    """Pass ``events`` through; the finished result says how long the context pass took."""
    for ev in events:
        if isinstance(ev, GenerationFinished):
            ev.result.context_pass_seconds = seconds
        yield ev


def _with_cache_bytes(events: Iterator[object], cache: TQCache) -> Iterator[object]:
    """Pass ``events`` through; after each token, report what the cache holds (prompt + tokens fed so far)."""
    for ev in events:
        yield ev
        if isinstance(ev, TokenGenerated):
            rep = cache.report()
            yield CacheBytes(ev.run, ev.step, rep.tokens, rep.compressed_storage_bytes, rep.resident_decode_bytes,
                             rep.dense_fp16_bytes)
