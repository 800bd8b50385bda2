"""What the server tells about itself: the tokenizer (vLLM's shapes), the last cache report, health."""

from __future__ import annotations

from tqbench import __version__
from tqbench.server.errors import APIError
from tqbench.server.schemas import chat_messages
from tqbench.server.stream import cache_report_body


class ServerInfo:
    """Mixed into ``Server``: needs ``engine``, ``worker``, ``policy``, ``model_id``, ``last``..."""

    def tokenizer_info(self) -> dict:
        tok = self.engine.tokenizer
        return {"tokenizer_class": type(tok).__name__, "model": self.model_id,
                "eos_token": tok.eos_token, "bos_token": tok.bos_token, "pad_token": tok.pad_token,
                "vocab_size": len(tok), "model_max_length": self.engine.max_context,
                "chat_template": getattr(tok, "chat_template", None)}

    def tokenize(self, req) -> dict:
        self.check_model(req.model)
        if req.messages is not None:
            if req.prompt is not None:
                raise APIError(400, "send either prompt or messages, not both", param="prompt",
                               code="invalid_value")
            messages = chat_messages(req)
            if req.add_generation_prompt:  # exactly what a chat request's prompt becomes
                tokens = self.engine.encode_prompt(messages, chat=True)[0].tolist()
            else:
                enc = self.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=False)
                tokens = list(enc["input_ids"] if not isinstance(enc, list) else enc)
        elif req.prompt is not None:
            tokens = self.engine.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"]
        else:
            raise APIError(422, "prompt: Field required (add it to the request)", param="prompt",
                           code="missing_field")
        return {"tokens": list(tokens), "count": len(tokens), "max_model_len": self.engine.max_context}

    def detokenize(self, req) -> dict:
        self.check_model(req.model)
        self.prompt_ids(req.tokens)  # the same vocabulary check as a token-id prompt
        return {"prompt": self.engine.tokenizer.decode(req.tokens)}

    def last_report(self) -> dict:
        """The last finished request's full cache report (per-layer rows included), named by its response id."""
        if self.last is None:
            raise APIError(404, "no request has finished yet: send a completion first, then ask again",
                           code="no_report")
        rid, created, result = self.last
        return {"object": "tqbench.cache_report", "id": rid, "created": created, "model": self.model_id,
                "kv_policy": result.kv_policy, "stopped_by": result.stopped_by,
                "cache_report": cache_report_body(result.cache_report, "layers")}

    def health(self) -> dict:
        return {
            "status": "ok" if self.worker.alive else "error",
            "model": self.model_id,
            "kv_policy": self.policy.label,
            "kv_policy_break_even_tokens": self.break_even_tokens,
            "cache_mode": self.cache_mode,
            "cache_mode_reason": self.mode_reason,
            "fused_implementation": self.fused_implementation(),
            "max_new_tokens": self.max_new_tokens,
            "queue": {"waiting": self.worker.waiting, "max": self.worker.max_queue,
                      "running": self.worker.running is not None},
            "batch": {"running": len(self.worker.running or ()), "max": self.worker.max_batch,
                      "last_step_size": self.worker.batch_size,
                      "kind": "/".join(self.worker.batch_key) if self.worker.batch_key else None,
                      "unbatched_reason": self.worker.unbatched_reason},
            "kv_budget": self.kv_usage(),
            "prefill_chunk": self.prefill_chunk,
            "prefix_cache": self.prefix_cache.stats(),
            "requests": dict(self.worker.stats),
            "version": __version__,
        }

    def kv_usage(self) -> dict:
        """The KV budget and what the running requests reserve of it (their caches at prompt + max_tokens)."""
        w = self.worker
        running = w.running_by_policy()
        waiting = w.waiting_by_policy()
        reserved = sum(b for _, b in running.values())
        return {"budget_bytes": self.kv_budget.bytes, "source": self.kv_budget.source, "reserved_bytes": reserved,
                "usage": reserved / self.kv_budget.bytes, "resident_bytes": w.kv_bytes["resident"],
                "running": sum(n for n, _ in running.values()), "waiting": w.waiting,
                "by_policy": {label: {"running": running.get(label, (0, 0))[0],
                                      "reserved_bytes": running.get(label, (0, 0))[1],
                                      "waiting": waiting.get(label, 0)}
                              for label in sorted({*running, *waiting})}}

    def fused_implementation(self) -> dict:
        """Which implementation a fused attention call runs on this server, and why."""
        from tqbench.server.modes import fused_implementation

        try:
            impl, why = fused_implementation(self.engine)
        except RuntimeError as exc:
            impl, why = None, str(exc)
        return {"implementation": impl, "why": why}
