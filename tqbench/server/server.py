"""``Server``: the state one app serves from (engine, default policy and mode, the worker thread).

Its jobs live in mixins, one module each: request checks (``checks``), running a request (``runner``),
what the server tells about itself (``info``).
"""

from __future__ import annotations

import time

from tqbench.engine import Policy, check_max_new_tokens, check_prefill_chunk
from tqbench.engine.cache import check_mode
from tqbench.server.admission import KVBudget
from tqbench.server.checks import RequestChecks
from tqbench.server.info import ServerInfo
from tqbench.server.modes import auto_mode
from tqbench.server.prefix import DEFAULT_PREFIX_CACHE, PrefixCache
from tqbench.server.runner import RequestRunner
from tqbench.server.stream import TokenTexts
from tqbench.server.worker import DEFAULT_MAX_BATCH, Worker


class Server(RequestChecks, RequestRunner, ServerInfo):
    """Validates requests, queues them on the worker and turns engine events into OpenAI responses."""

    def __init__(self, engine, *, kv_policy: str | Policy, cache_mode: str, max_new_tokens: int,
                 max_queue: int, model_aliases: tuple[str, ...] = (), max_batch: int = DEFAULT_MAX_BATCH,
                 prefill_chunk: int = 0, kv_budget: KVBudget | str | int | None = None,
                 prefix_cache: PrefixCache | str | int | None = DEFAULT_PREFIX_CACHE) -> None:
        check_max_new_tokens(max_new_tokens)
        check_prefill_chunk(prefill_chunk)
        self.prefill_chunk = prefill_chunk
        self.texts = TokenTexts(engine.tokenizer)
        self.engine = engine
        self.policy = engine.check_policy(kv_policy)
        #: the default policy was fitted on another model (``Engine.policy_warning``): the start-up line, every
        #: response's ``tqbench.policy_warning`` and its ``X-TQBench-Policy-Warning`` header say so
        self.policy_warning = engine.policy_warning(self.policy)
        #: the length from which the default policy stores fewer bytes than fp16 (None: never within the context)
        self.break_even_tokens = engine.savings(self.policy, "fp16", 1).break_even_tokens
        if cache_mode == "auto":
            cache_mode, self.mode_reason = auto_mode(engine)
        else:
            self.mode_reason = f"cache_mode={cache_mode!r} was asked for"
        self.cache_mode = check_mode(cache_mode)
        self.max_new_tokens = max_new_tokens
        self.model_id = engine.name
        self.error_responses: dict[int, int] = {}  # HTTP status -> error responses sent (errors.install_error_handlers)
        self.model_names = {engine.name, *[a for a in model_aliases if a]}
        if self.cache_mode == "fused":
            engine.enable_fused()
        if not isinstance(kv_budget, KVBudget):
            kv_budget = KVBudget.resolve(kv_budget, _device_type(engine))
        self.kv_budget = kv_budget
        #: compressed shared prefixes (``server.prefix``): a byte cap, least recently used evicted first
        self.prefix_cache = prefix_cache if isinstance(prefix_cache, PrefixCache) else PrefixCache(prefix_cache)
        self.worker = Worker(engine, max_queue, max_batch, kv_budget=kv_budget.bytes, prefix_cache=self.prefix_cache)
        self.started = int(time.time())
        self.last: tuple[str, int, object] | None = None  # (response id, created, result) of the last finish


    def break_even_line(self) -> str:
        """The start-up line on the served policy's bytes (``break_even_tokens``)."""
        even = self.break_even_tokens
        head = f"kv_policy {self.policy.label} stores fewer bytes than fp16 "
        if even is None:
            return head + "at no length within the model's context: it saves nothing"
        return head + f"from {even} tokens on (shorter requests save nothing: tqbench.savings in each response)"


def _device_type(engine) -> str:
    loaded = getattr(engine, "loaded", None)
    return str(getattr(loaded, "device", "cpu")).split(":")[0]
