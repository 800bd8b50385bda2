"""A saved session's summary is validate's: the same same-context KL, first divergence and token match."""

import json

import pytest

from tqbench.engine.validate import validate
from tqbench.sessions import Session, record_from_validation, save_session

PROMPT = "hello there"


@pytest.fixture(scope="module")
def report(tiny_engine):
    return validate(tiny_engine, PROMPT, "fp16", "turbo2", max_new_tokens=16, collect_logits=True)


def test_a_saved_validation_has_validates_numbers(tmp_path, tiny_engine, report):
    first = report.comparison.first_divergence_index
    assert first is not None and first < 15, "turbo2 on the tiny model is expected to diverge early"
    rec = record_from_validation(report)
    path = save_session(Session(runs=[rec], validations=[report.to_dict()]), tmp_path / "v.json",
                        engine=tiny_engine, model_spec="tiny")
    back = Session.load(path).runs[0]
    summary = back.summary()
    logits = report.logit_comparison
    assert summary["kl_mean"] == logits.kl_mean and summary["kl_max"] == logits.kl_max
    assert summary["first_divergence"] == first
    assert summary["token_match"] == report.comparison.token_match_ratio
    assert summary["top1_agreement"] == report.step_comparison.top1_match_ratio
    assert summary["exact_match"] is report.comparison.exact_match is False
    assert json.loads(path.read_text())["runs"][0]["summary"] == summary
    # same-context KL: the steps after the divergence (different histories) are not in the mean
    assert logits.after_divergence_steps == 16 - first - 1 and logits.steps_compared == first + 1
    assert summary["kl_mean"] != pytest.approx(sum(back.kl) / len(back.kl))


def test_the_validation_run_keeps_its_tokens_and_texts(report):
    rec = record_from_validation(report)
    assert rec.kind == "validate" and rec.prompt == PROMPT and rec.max_new_tokens == 16
    assert rec.candidate.policy == "turbo2" and rec.candidate.policy_string == report.candidate_policy
    assert rec.candidate.cache_report["kv_policy"] == "turbo2"
    for name in ("baseline", "candidate"):
        side = getattr(rec, name)
        assert side.token_ids == report.token_ids.of(name) and side.text == report.texts.of(name)
        assert len(side.token_texts) == len(side.token_ids) and "".join(side.token_texts) == side.text


def test_a_teacher_forced_report_has_no_run():
    from tqbench.engine.validate import TeacherForcedReport

    assert record_from_validation(TeacherForcedReport("tiny-random", "prompt", "compressed", 4, 4)) is None
