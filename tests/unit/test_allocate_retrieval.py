"""The tokens axis's retrieval price (issue 40 item 4): keep cells priced on needle probes held out from the task
suite, measured on the gold answer's tokens only, and read by the solver beside the calibration KL."""

from __future__ import annotations

import pytest
import torch

from tqbench.engine.allocate import allocate_policy
from tqbench.engine.allocate.keeps import _through
from tqbench.engine.allocate.retrieval import RetrievalCells, check_probes, make_probes, price_key
from tqbench.engine.metrics import kl_from_logits
from tqbench.engine.request import RequestError

SMALL = dict(calib_prefill=48, calib_steps=8, verify_prefill=48, verify_steps=6, context=96,
             base="sink=2,recent=4,window=4", protections=[], max_measurements=0)


@pytest.fixture(scope="module")
def probes(tiny_engine):
    return make_probes(tiny_engine, 3, 1024)


def test_probes_fit_are_deterministic_and_held_out_from_the_suite(tiny_engine, probes):
    from tqbench.engine.tasks.generate import vocabulary
    from tqbench.engine.validate.niah import _sentences

    again = make_probes(tiny_engine, 3, 1024)
    assert [p.kind for p in probes] == ["single", "chain", "multikey"]
    tok = tiny_engine.tokenizer
    suite_sentences = set(_sentences())
    for p, q in zip(probes, again):
        assert torch.equal(p.ids, q.ids) and (p.cut, p.answer) == (q.cut, q.answer)
        assert p.ids.shape[1] <= 1024 and 0 < p.cut < p.answer < p.ids.shape[1]
        text = tok.decode(p.ids[0])
        assert not any(s in text for s in suite_sentences)  # no filler sentence of the suite's needle tasks
    single = tok.decode(probes[0].ids[0])
    key = single.split("special magic number for ")[-1].split(" mentioned")[0]
    value = tok.decode(probes[0].ids[0, probes[0].answer:]).strip(" .")
    assert key not in vocabulary() and f"{key} is: {value}." in single  # the gold answer is the needle's value
    assert tok.decode(probes[0].ids[0, probes[0].cut:]).lstrip().startswith("What is the special magic number")


def test_the_price_is_the_answer_tokens_kl(tiny_engine, probes):
    """A cell's price is the mean KL over the gold answer's tokens only, with the rows the ranker evicts masked out
    in that layer (agnostic: evicted at the end of the context; aware: at the end of the prompt)."""
    p = probes[0]
    rc = RetrievalCells(tiny_engine, [p], ("agnostic", "aware"), "snapkv", 8)
    (_, a_proto, agn), (_, w_proto, awr) = rc.cells
    assert (a_proto, w_proto) == ("agnostic", "aware")
    assert agn.runner.prefill == p.cut and awr.runner.prefill == p.answer - 1
    r = agn.runner
    idx = agn.index(1, 0.25, 2, 4)
    with torch.inference_mode(), _through(r.model, masks={1: agn.mask(idx)}):
        logits = r._forward(list(r.keys), list(r.values), 1)
    every = kl_from_logits(r._p, r._base_logits, r._base_lse, logits)[0]  # [chunk positions]
    first = p.answer - 1 - p.cut  # the position whose next token is the answer's first
    assert agn.cell(1, 0.25, 2, 4) == pytest.approx(float(every[first:].mean()), rel=1e-5)
    assert float(every[first:].mean()) != pytest.approx(float(every.mean()), rel=1e-3)  # the question's tokens don't count
    both = rc.cell(1, 0.25, 2, 4)
    assert both == pytest.approx((agn.cell(1, 0.25, 2, 4) + awr.cell(1, 0.25, 2, 4)) / 2)
    assert both > 0 and rc.cell(1, 1.0, 2, 4) == 0.0  # keeping every row costs nothing


def test_the_solver_reads_keep_plus_weighted_price(tiny_engine, tmp_path):
    """The solve minimises calibration KL + weight x probe price per keep cell: the allocation's additive prediction
    is that sum over its chosen cells; the prices persist in the partial file and are resumed, not re-measured."""
    partial = str(tmp_path / "p.json")
    kw = dict(axes="bits,tokens", codecs=["turbo4"], k_codecs=["turbo4"], probes=1, probe_protocols="agnostic",
              probe_context=1024, partial_path=partial, **SMALL)
    reps = {w: allocate_policy(tiny_engine, 3.5, probe_weight=w, **kw) for w in (0.0, 1000.0)}
    for w, rep in reps.items():
        ret = rep.axes["retrieval"]
        assert (ret["probes"], ret["weight"], ret["protocols"]) == (1, w, ["agnostic"])
        assert set(ret["price"]) == set(rep.axes["keep_cells"]) and all(v > 0 for v in ret["price"].values())
        g = rep.allocation.policy.plan(4)
        keep_part = sum(rep.axes["keep_cells"][f"{p.layer}/{p.keep:g}"] + w * ret["price"][f"{p.layer}/{p.keep:g}"]
                        for p in g if p.evicts and p.keep < 1)
        codec_part = sum(rep.table.kl[u][c] for u, c in rep.allocation.choice.items())
        assert rep.allocation.predicted_kl == pytest.approx(keep_part + codec_part, rel=1e-9)
    assert reps[0.0].axes["retrieval"]["price"] == reps[1000.0].axes["retrieval"]["price"]  # resumed, same cells

    def price_paid(rep):
        ret = rep.axes["retrieval"]["price"]
        return sum(ret[f"{p.layer}/{p.keep:g}"] for p in rep.allocation.policy.plan(4) if p.evicts and p.keep < 1)

    assert price_paid(reps[1000.0]) <= price_paid(reps[0.0])
    import json

    cells = json.loads(open(partial).read())["cells"]
    assert price_key(0, None, "snapkv", 4, 0.5, 1, 1, 1024, ("agnostic",)) in cells


@pytest.mark.parametrize("args,msg", [((-1, 1.0, "agnostic"), "give 0"), ((3, -1.0, "aware"), "weight"),
                                      ((3, 1.0, "both"), "agnostic, aware")])
def test_bad_probe_options_are_refused(args, msg):
    with pytest.raises(RequestError, match=msg):
        check_probes(*args)
