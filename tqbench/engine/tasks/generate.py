"""The suite's samples, generated offline and deterministically (RULER-style, Hsieh et al. 2024).

Every sample is one user message of the model's chat template, filled to a target context of N tokens (prompt +
the task's new tokens <= N, within ``FIT_SLACK`` of it) and drawn from ``random.Random`` seeded by (seed, task,
context, index): the same arguments give the same prompt, token for token. Filler text is the shipped corpus
(``tqbench/data/corpus``, via ``validate.niah``'s haystack) or RULER's repeated noise sentences; QA documents are the
paragraphs of every text the project ships (``tqbench/data/{corpus,heldout,calibration}``).

A task is a ``TaskSpec`` (``spec.TASKS``); its ``build(rng, length, index, n)`` returns (user text, references,
answer prefix) for a filler budget of ``length`` tokens; ``make_sample`` searches the budget that fits the context.
"""

from __future__ import annotations

import functools
import random
import re
from dataclasses import dataclass

from tqbench.constants import PACKAGE_DATA_DIR
from tqbench.engine.validate.niah import _sentences, build_haystack_needles

#: RULER's noise haystack (the variable-tracking and niah "noise" filler)
NOISE = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
#: a sample's prompt + new tokens lands within this many tokens under the target context
FIT_SLACK = 64
QA_DIRS = ("corpus", "heldout", "calibration")
_STOP = {"which", "their", "there", "these", "those", "where", "while", "about", "after", "other", "would",
         "could", "should", "every", "being", "because", "through", "between", "before", "under", "again"}


@dataclass(frozen=True)
class Sample:
    """One prompt of the suite: ``text`` is the user message, ``references`` what a right answer contains."""

    task: str
    index: int
    text: str
    references: tuple[str, ...]
    answer_prefix: str  # the start of the assistant's turn (RULER's answer prefix), part of ``ids``
    ids: object  # torch.Tensor [1, T]: the chat template's user turn, then the answer prefix

    @property
    def prompt_tokens(self) -> int:
        return int(self.ids.shape[1])


# ---- shared material ---------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def vocabulary() -> tuple[str, ...]:
    """Distinct lowercase words of 5-10 letters of the shipped corpus, sorted: keys and common-words draws."""
    words = set(re.findall(r"\b[a-z]{5,10}\b", " ".join(_sentences())))
    return tuple(sorted(words - _STOP))


def magic_number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _depths(index: int, n: int, rng: random.Random, k: int = 1) -> list[float]:
    """k needle depths for sample ``index`` of ``n``: the first spread evenly over samples (10%..90%), the rest
    drawn uniformly."""
    first = 0.1 + 0.8 * (index + 0.5) / max(n, 1)
    return [first] + [rng.uniform(0.05, 0.95) for _ in range(k - 1)]


def _needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def _niah_text(haystack: str, question: str) -> str:
    return (f"Some special magic numbers are hidden within the following text. Make sure to memorize them. I will "
            f"quiz you about the numbers afterwards.\n\n{haystack}\n\n{question}")


# ---- tasks -------------------------------------------------------------------------------------------------
def build_niah_single(tok, rng: random.Random, length: int, index: int, n: int):
    key, value = rng.choice(vocabulary()), magic_number(rng)
    hay, _ = build_haystack_needles(tok, length, [(_depths(index, n, rng)[0], _needle(key, value))])
    q = f"What is the special magic number for {key} mentioned in the provided text?"
    return _niah_text(hay, q), (value,), f"The special magic number for {key} mentioned in the provided text is"


def build_niah_multikey(tok, rng: random.Random, length: int, index: int, n: int, keys: int = 4):
    names = rng.sample(vocabulary(), keys)
    values = [magic_number(rng) for _ in names]
    depths = _depths(index, n, rng, keys)  # the asked key (first) at the evenly spread depth
    hay, _ = build_haystack_needles(tok, length, [(d, _needle(k, v)) for d, k, v in zip(depths, names, values)])
    q = f"What is the special magic number for {names[0]} mentioned in the provided text?"
    return _niah_text(hay, q), (values[0],), f"The special magic number for {names[0]} mentioned in the provided text is"


def build_niah_multivalue(tok, rng: random.Random, length: int, index: int, n: int, values: int = 2):
    key = rng.choice(vocabulary())
    vals = [magic_number(rng) for _ in range(values)]
    depths = sorted(_depths(index, n, rng, values))
    hay, _ = build_haystack_needles(tok, length, [(d, _needle(key, v)) for d, v in zip(depths, vals)])
    q = f"What are all the special magic numbers for {key} mentioned in the provided text?"
    return _niah_text(hay, q), tuple(vals), f"The special magic numbers for {key} mentioned in the provided text are"


def _var_name(rng: random.Random) -> str:
    return "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))


def build_variable_tracking(tok, rng: random.Random, length: int, index: int, n: int, hops: int = 2):
    names = []
    while len(names) < hops + 1:
        v = _var_name(rng)
        if v not in names:
            names.append(v)
    value = str(rng.randint(10_000, 99_999))
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, hops + 1)]
    depths = sorted(_depths(index, n, rng, len(chain)))
    hay, _ = build_haystack_needles(tok, length, list(zip(depths, chain)), pool=list(NOISE))
    text = (f"Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{hay}\n\n"
            f"Question: Find all variables that are assigned the value {value} in the text above.")
    prefix = (f"Answer: According to the chain(s) of variable assignment in the text above, {hops + 1} variables "
              f"are assigned the value {value}, they are:")
    return text, tuple(names), prefix


def build_common_words(tok, rng: random.Random, length: int, index: int, n: int, top: int = 3,
                       common_freq: int = 30, rare_freq: int = 1):
    """A numbered list of words: ``top`` words ``common_freq`` times each, as many other words as fit
    ``rare_freq`` times each, shuffled; the answer is the ``top`` most common words."""
    vocab = list(vocabulary())
    rng.shuffle(vocab)
    common, rare = vocab[:top], vocab[top:]
    per_word = max(1, len(tok(" 10. " + common[0], add_special_tokens=False)["input_ids"]))
    slots = max(length // per_word - top * common_freq, top)
    words = common * common_freq + [w for w in rare[: slots // rare_freq] for _ in range(rare_freq)]
    rng.shuffle(words)
    listing = " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))
    text = (f"Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
            f"ones that appear most often.\n{listing}\nQuestion: What are the {top} most common words in the "
            f"above list?")
    return text, tuple(common), f"Answer: The top {top} words that appear most often in the list are:"


@functools.lru_cache(maxsize=1)
def qa_paragraphs() -> tuple[str, ...]:
    """Every paragraph of the shipped texts (README files aside), in a fixed order: the QA documents."""
    paras = []
    for d in QA_DIRS:
        for p in sorted((PACKAGE_DATA_DIR / d).glob("*.txt")):
            paras += [" ".join(x.split()) for x in p.read_text(encoding="utf-8").split("\n\n") if len(x.split()) > 20]
    return tuple(paras)


#: (question, answers, a phrase only the gold paragraph holds): written for the shipped corpus texts
QA_PAIRS = (
    ("What elastic material forms when the proteins of moistened wheat flour link together?", ("gluten",),
     "forming a continuous, elastic material called gluten"),
    ("What gas produced by yeast makes bread dough rise?", ("carbon dioxide",),
     "The carbon dioxide is what makes the dough rise"),
    ("What do bakers call the rapid expansion of a loaf in the first minutes of baking?", ("oven spring",),
     "in what bakers call oven spring"),
    ("Which reaction between sugars and proteins gives bread crust its brown color?", ("maillard",),
     "Maillard reaction"),
    ("On which island stood the famous early lighthouse at the harbor of Alexandria?", ("pharos",),
     "on the island of Pharos"),
    ("Which physicist developed the lighthouse lens in France in the early nineteenth century?", ("fresnel",),
     "by the physicist Augustin Fresnel"),
    ("On what liquid were heavy rotating lighthouse lenses floated?", ("mercury",), "floated on baths of mercury"),
    ("What curved lake forms when a river's abandoned meander loop is cut off?", ("oxbow",),
     "it becomes a curved lake called an oxbow"),
    ("What is the gently sloping deposit on the inside of a river bend called?", ("point bar",),
     "known as a point bar"),
    ("What are the low ridges of coarse material that floods build beside a river channel called?",
     ("levee",), "building low ridges called natural levees"),
)


def build_qa(tok, rng: random.Random, length: int, index: int, n: int):
    question, answers, marker = QA_PAIRS[index % len(QA_PAIRS)]
    paras = qa_paragraphs()
    gold = next(p for p in paras if marker in p)
    others = [p for p in paras if p != gold]
    rng.shuffle(others)
    docs, used = [gold], len(tok(gold, add_special_tokens=False)["input_ids"])
    for p in others:
        if used >= length:
            break
        docs.append(p)
        used += len(tok(p, add_special_tokens=False)["input_ids"]) + 4
    pos = min(len(docs) - 1, int(_depths(index, n, rng)[0] * len(docs)))
    docs.insert(pos, docs.pop(0))
    listing = "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(docs))
    ask = "Answer the question based on the given documents. Only give me the answer and do not output any other words."
    text = f"{ask}\n\nThe following are given documents.\n\n{listing}\n\n{ask}\n\nQuestion: {question}"
    return text, answers, "Answer:"


def _encode(engine, text: str, prefix: str):
    """The user turn on the chat template, then ``prefix`` as the start of the assistant's answer."""
    import torch

    ids = engine.encode_prompt(text, True, fit_context=False)
    tail = engine.tokenizer(prefix, add_special_tokens=False,
                            return_tensors="pt")["input_ids"]
    return torch.cat([ids, tail.to(ids.dtype)], dim=1)


def question_start(engine, sample: Sample) -> int:
    """The first token of ``sample``'s question: every task's user text ends with one line that asks (after its
    last newline); the context is the tokens the prompt shares with the chat template over the text before that
    line (a token that spans the cut, such as a merged newline, goes to the question). The query-agnostic protocol
    compresses ``ids[:, :question_start]`` before the rest is appended."""
    ctx = engine.encode_prompt(sample.text[: sample.text.rfind("\n")], True, fit_context=False)[0]
    return _shared_cut(ctx, sample, "context before the question")


def _shared_cut(ids, sample: Sample, what: str) -> int:
    """How many leading tokens ``ids`` shares with ``sample``'s prompt; a ``ValueError`` naming ``what`` when that
    leaves nothing before the cut or nothing after it."""
    full = sample.ids[0]
    n = min(len(ids), len(full))
    same = (ids[:n] == full[:n]).tolist()
    cut = same.index(False) if False in same else n
    if cut < 1 or cut >= len(full):
        raise ValueError(f"{sample.task} #{sample.index}: no {what} to compress")
    return cut


def user_turn_end(engine, sample: Sample) -> int:
    """The first token after ``sample``'s user text (the question included): what the template adds after the
    user's turn (end of turn, the assistant's header) and the answer prefix start here. kvpress's query-aware runs
    compress up to this point and append the rest (its pipeline splits the template on a separator the same way)."""
    sep = "#" * 16  # no text of the suite ends in '#'; its tokens never merge with the template's
    ids = engine.encode_prompt(sample.text + sep, True, fit_context=False)[0]
    return _shared_cut(ids, sample, "user turn before the answer")


# ---- fitting a sample to the context -----------------------------------------------------------------------
def make_sample(engine, task, context: int, index: int, n: int, seed: int) -> Sample:
    """Sample ``index`` of ``n`` of ``task`` (a ``spec.TaskSpec``) at ``context`` tokens: the filler budget is
    searched so that prompt + the task's new tokens fits ``context`` within ``FIT_SLACK`` (from above: never over).
    The seed depends on (seed, task, context, index) only."""
    tok = engine.tokenizer
    budget = context - task.max_new_tokens
    overhead = _encode(engine, *task.build(tok, random.Random(0), 16, 0, 1)[::2])
    length = max(16, budget - int(overhead.shape[1]))
    best = None
    for _ in range(12):
        rng = random.Random(f"{seed}/{task.name}/{context}/{index}")
        text, refs, prefix = task.build(tok, rng, length, index, n)
        ids = _encode(engine, text, prefix)
        over = int(ids.shape[1]) - budget
        if over <= 0 and (best is None or ids.shape[1] > best.ids.shape[1]):
            best = Sample(task.name, index, text, tuple(refs), prefix, ids)
        if over <= 0 and -over <= FIT_SLACK:
            break
        length = max(16, length - over - (FIT_SLACK // 4 if over > 0 else FIT_SLACK // 2))
    if best is None:
        raise ValueError(f"could not fit a {task.name} sample to {context} tokens (prompt {int(ids.shape[1])} + "
                         f"{task.max_new_tokens} new): use a larger context")
    return best
